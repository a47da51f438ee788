"""Three AdamW steps under every layout of the tp / sp / cp issue equal one process (losses,
first-step gradients, final parameters): tp2, tp2+sp, cp2 Ulysses, cp2 Ring (causal and full),
cp4 hybrid, tp2 x cp2, tp2+sp x ring2, each with recompute; LoRA on tp2 and tp2+sp."""

import pytest
from helpers.lora_cases import write_adapters
from helpers.training_cases import run_training_cases

pytestmark = pytest.mark.distributed

ALL_MODES = ["none", "full", "block1", "selective"]


def cases(world, adapter_dir):
    if world == 2:
        return {
            "tp2": {"layout": {"tp": 2}, "recompute": ALL_MODES},
            "tp2_sp": {"layout": {"tp": 2, "sequence_parallel": True}, "recompute": ALL_MODES},
            "ulysses2": {"layout": {"cp": 2}, "recompute": ALL_MODES},
            "ring2": {"layout": {"cp": 2, "cp_algo": "ring"}, "recompute": ALL_MODES, "causal": [True, False]},
            "lora_tp2": {"layout": {"tp": 2}, "adapter_dir": adapter_dir, "recompute": ["none", "full"]},
            "lora_tp2_sp": {"layout": {"tp": 2, "sequence_parallel": True}, "adapter_dir": adapter_dir},
        }
    return {
        "hybrid2x2": {"layout": {"cp": 4, "cp_algo": "hybrid", "ulysses_degree": 2},
                      "recompute": ["none", "full", "selective"], "causal": [True, False]},
        "tp2_ulysses2": {"layout": {"tp": 2, "cp": 2}, "recompute": ALL_MODES},
        "tp2_sp_ring2": {"layout": {"tp": 2, "cp": 2, "cp_algo": "ring", "sequence_parallel": True},
                         "recompute": ["none", "full", "selective"]},
    }


def expected_keys(spec):
    return {f"{name}/{mode}/{'causal' if causal else 'full'}" for name, case in spec.items()
            for causal in case.get("causal", [True]) for mode in case.get("recompute", ["none"])}


@pytest.mark.parametrize("world", [2, 4])
def test_three_adamw_steps_equal_single_process(run_distributed, tmp_path, world):
    write_adapters(tmp_path)
    spec = cases(world, str(tmp_path))
    results = run_distributed(run_training_cases, nproc=world, timeout=600, cases=spec)
    for rank, result in enumerate(results):
        assert set(result) == expected_keys(spec)
        failed = {case: p for case, p in result.items() if p}
        assert not failed, (rank, failed)
