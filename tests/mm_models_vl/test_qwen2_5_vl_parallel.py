"""Qwen2.5-VL loaded with from_pretrained under a layout trains like one process: two
DistributedOptimizer steps, losses, first-step gathered gradients and final parameters
(rel-err <= 1e-4; losses rtol 1e-5). See qwen_vl_parallel_cases.py."""

import pytest

from qwen_vl_parallel_cases import run_parallel_cases
from qwen_vl_reference import write_adapters, write_reference

pytest.importorskip("torch")
pytestmark = pytest.mark.distributed

TWO = {
    "tp2": {"layout": {"tp": 2}},
    "tp2_sp": {"layout": {"tp": 2, "sequence_parallel": True}},
    "ulysses2": {"layout": {"cp": 2}},
    "ring2": {"layout": {"cp": 2, "cp_algo": "ring"}},
    "dp2_zero1": {"layout": {"zero_stage": 1}},
    "lora_tp2": {"layout": {"tp": 2}, "lora": True},
    "tp2_sp_recompute_full": {"layout": {"tp": 2, "sequence_parallel": True}, "recompute": "full"},
    "ring2_recompute_selective": {"layout": {"cp": 2, "cp_algo": "ring"}, "recompute": "selective"},
    "ulysses2_recompute_block": {"layout": {"cp": 2}, "recompute": "block"},
    "tp2_frozen_vision": {"layout": {"tp": 2}, "freeze": ("vision",)},
}


def test_two_process_layouts_equal_single_process(run_distributed, tmp_path):
    write_adapters(tmp_path / "adapters", write_reference(tmp_path))
    results = run_distributed(run_parallel_cases, nproc=2, timeout=600, path=str(tmp_path), cases=TWO)
    for rank, result in enumerate(results):
        assert set(result) == set(TWO)
        failed = {case: problems for case, problems in result.items() if problems}
        assert not failed, (rank, failed)
