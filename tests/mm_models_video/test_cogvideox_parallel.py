"""CogVideoX's transformer loaded with from_pretrained under a layout trains like one process: two
DistributedOptimizer steps; losses (rtol 1e-5), first-step gathered gradients and final
parameters (rel-err <= 1e-4). The joint text + video sequence is what tp-sp and cp split (text
rows land on several ranks under ring's zigzag); the padded_* cases' joint length does not
divide, so the model pads it (masked keys, rows dropped from loss and sample). The bf16_* cases
run in bf16 against the bf16 single process, within mm_parallel.testing.equivalence.BF16_TOLERANCE.
See cogvideox_parallel_cases.py."""

import diffusers  # noqa: F401  (the parity reference: required, see tests/conftest.py)
import pytest
from helpers.cogvideox_parallel_cases import run_parallel_cases
from helpers.cogvideox_reference import CONFIGS, write_adapters, write_reference
from helpers.device_path_cases import one_process_cases

from mm_parallel.testing.device_path import RING_CALLS, calls_made, check_stand_in_calls, on_stand_ins
from mm_parallel.testing.equivalence import BF16_TOLERANCE, check_results

pytestmark = pytest.mark.distributed

T2V, DEEP, I2V = "1.0-t2v", "1.0-t2v/deep", "1.5-i2v"  # DEEP: 4 blocks, for pp2 x vpp2
# 4 heads (tp2 x ulysses2 splits them twice); a sample grid that holds the 4 x 4 patches (1.5 slices it)
SHAPE = dict(num_attention_heads=4, sample_height=8, sample_width=8)

TWO = {
    "tp2": {"layout": {"tp": 2}, "checkpoint": T2V},
    "tp2_sp": {"layout": {"tp": 2, "sequence_parallel": True}, "checkpoint": T2V},
    "ulysses2": {"layout": {"cp": 2}, "checkpoint": T2V},
    "ring2": {"layout": {"cp": 2, "cp_algo": "ring"}, "checkpoint": T2V},
    "dp2_zero1": {"layout": {"zero_stage": 1}, "checkpoint": T2V},
    "pp2": {"layout": {"pp": 2}, "checkpoint": T2V},
    "pp2_vpp2": {"layout": {"pp": 2, "vpp": 2}, "checkpoint": DEEP},
    "lora_tp2": {"layout": {"tp": 2}, "lora": True, "checkpoint": T2V},
    "tp2_sp_recompute_full": {"layout": {"tp": 2, "sequence_parallel": True}, "recompute": "full", "checkpoint": T2V},
    "ring2_recompute_selective": {"layout": {"cp": 2, "cp_algo": "ring"}, "recompute": "selective",
                                  "checkpoint": T2V},
    "i2v_1_5_tp2_sp": {"layout": {"tp": 2, "sequence_parallel": True}, "checkpoint": I2V},
    "i2v_1_5_ulysses2": {"layout": {"cp": 2}, "checkpoint": I2V},
    # 7 text + 48 video rows: padded to 56 (masked keys, dropped rows) where the layout cuts them
    "padded_ring2": {"layout": {"cp": 2, "cp_algo": "ring"}, "checkpoint": T2V, "text_rows": 7},
    "padded_tp2_sp": {"layout": {"tp": 2, "sequence_parallel": True}, "checkpoint": T2V, "text_rows": 7},
}

# bf16 (mm_parallel.precision) against the bf16 single process, to bf16's precision
TWO.update({f"bf16_{name}": {**TWO[name], "precision": "bf16", "tolerance": BF16_TOLERANCE}
            for name in ("tp2_sp", "ring2", "pp2", "dp2_zero1")})

# the Ascend path on its stand-ins (1.0 and 1.5): the ring's kernel blocks over a padded joint
# sequence; bf16 with bf16 operands, as on Ascend
TWO.update(on_stand_ins(TWO, ("padded_ring2", "i2v_1_5_ulysses2")))
TWO.update(on_stand_ins(TWO, ("tp2_sp",), "ascend_bf16_", BF16_TOLERANCE))
FUSED = ("rotary_position_embedding",)  # attention: the function, or the primitive in the ring's blocks

FOUR = {
    "hybrid2x2": {"layout": {"cp": 4, "cp_algo": "hybrid", "ulysses_degree": 2}, "checkpoint": T2V},
    "tp2_ulysses2": {"layout": {"tp": 2, "cp": 2}, "checkpoint": T2V},
    "tp2_sp_ring2": {"layout": {"tp": 2, "sequence_parallel": True, "cp": 2, "cp_algo": "ring"}, "checkpoint": T2V},
    "pp2_dp2_zero1": {"layout": {"pp": 2, "zero_stage": 1}, "checkpoint": T2V},
    "lora_pp2_tp2": {"layout": {"pp": 2, "tp": 2}, "lora": True, "checkpoint": T2V},
    "i2v_1_5_pp2_tp2_sp": {"layout": {"pp": 2, "tp": 2, "sequence_parallel": True}, "checkpoint": I2V},
    "padded_tp2_sp_ring2": {"layout": {"tp": 2, "sequence_parallel": True, "cp": 2, "cp_algo": "ring"},
                            "checkpoint": T2V, "text_rows": 7},
    "padded_hybrid2x2": {"layout": {"cp": 4, "cp_algo": "hybrid", "ulysses_degree": 2}, "checkpoint": T2V,
                         "text_rows": 7},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("cogvideox_parallel")
    for folder, kind, extra in ((T2V, T2V, {}), (DEEP, T2V, {"num_layers": 4}), (I2V, I2V, {})):
        CONFIGS[f"parallel:{folder}"] = dict(CONFIGS[kind], **SHAPE, **extra)
        write_adapters(root / folder / "adapters", write_reference(root / folder, f"parallel:{folder}"))
    return root


def test_one_process_on_the_ascend_path_equals_the_cpu_path(checkpoints):
    """CogVideoX 1.0 (T2V) and 1.5 (I2V) on the stand-ins in one process, fp32 and bf16."""
    cases = one_process_cases(t2v_1_0=T2V, i2v_1_5=I2V)
    results = [run_parallel_cases(str(checkpoints), cases)]
    check_results(results, cases)
    check_stand_in_calls(results, cases, FUSED + ("flash_attention_score",))


def test_two_process_layouts_equal_single_process(run_distributed, checkpoints):
    results = run_distributed(run_parallel_cases, nproc=2, timeout=600, path=str(checkpoints), cases=TWO)
    check_results(results, TWO)
    check_stand_in_calls(results, TWO, FUSED)
    made = calls_made(results, TWO)
    assert RING_CALLS <= set(made["ascend_padded_ring2"])  # the ring's own blocks
    assert all("flash_attention_score" in calls for name, calls in made.items() if "ring" not in name), made


def test_four_process_layouts_equal_single_process(run_distributed, checkpoints):
    check_results(run_distributed(run_parallel_cases, nproc=4, timeout=900, path=str(checkpoints), cases=FOUR), FOUR)
