"""Wan's DiT loaded with from_pretrained under a layout trains like one process: two
DistributedOptimizer steps of the flow-matching loss; losses (rtol 1e-5), first-step gathered
gradients and final parameters (rel-err <= 1e-4). Pipeline stages compare the parameters they
hold; together they must cover the whole model. See wan_parallel_cases.py. The ti2v_* cases take
Wan2.2 TI2V's per-token timesteps; the A14B experts are Wan2.1's architecture (the t2v and i2v
checkpoints' cases).
The bf16_* cases run in bf16 (mm_parallel.precision) against the bf16 single process, within
mm_parallel.testing.equivalence.BF16_TOLERANCE."""

import diffusers  # noqa: F401  (the parity reference: required, see tests/conftest.py)
import pytest
from helpers.device_path_cases import one_process_cases
from helpers.wan_parallel_cases import run_parallel_cases
from helpers.wan_reference import write_adapters, write_reference

from mm_parallel.testing.device_path import HCCL_CALLS, RING_CALLS, calls_made, on_stand_ins
from mm_parallel.testing.device_path import check_stand_in_calls as stand_in_calls
from mm_parallel.testing.equivalence import BF16_TOLERANCE, check_results

pytestmark = pytest.mark.distributed

DEEP, I2V = "deep", "i2v"  # a 4-block T2V checkpoint; the I2V checkpoint (image tokens, added k/v)
TI2V = "first_frame"  # Wan2.2 TI2V's per-token timesteps (wan_reference.first_frame_timesteps)
HEADS = dict(num_attention_heads=4)  # 4 heads: tp2 x ulysses2 splits them twice

TWO = {
    "tp2": {"layout": {"tp": 2}},
    "tp2_sp": {"layout": {"tp": 2, "sequence_parallel": True}},
    "ulysses2": {"layout": {"cp": 2}},
    "ring2": {"layout": {"cp": 2, "cp_algo": "ring"}},
    "dp2_zero1": {"layout": {"zero_stage": 1}},
    "pp2": {"layout": {"pp": 2}},
    "pp2_vpp2": {"layout": {"pp": 2, "vpp": 2}, "checkpoint": DEEP},
    "lora_tp2": {"layout": {"tp": 2}, "lora": True},
    "tp2_sp_recompute_full": {"layout": {"tp": 2, "sequence_parallel": True}, "recompute": "full"},
    "ring2_recompute_selective": {"layout": {"cp": 2, "cp_algo": "ring"}, "recompute": "selective"},
    "ulysses2_recompute_block": {"layout": {"cp": 2}, "recompute": "block"},
    "i2v_tp2_sp": {"layout": {"tp": 2, "sequence_parallel": True}, "checkpoint": I2V},
    "i2v_ulysses2": {"layout": {"cp": 2}, "checkpoint": I2V},
    "i2v_pp2": {"layout": {"pp": 2}, "checkpoint": I2V},
    # Wan2.2 TI2V's per-token timesteps (the first frame's at 0): their indices cut with the tokens
    "ti2v_tp2_sp": {"layout": {"tp": 2, "sequence_parallel": True}, "token_timesteps": TI2V},
    "ti2v_ring2": {"layout": {"cp": 2, "cp_algo": "ring"}, "token_timesteps": TI2V},
    "ti2v_ulysses2_recompute_full": {"layout": {"cp": 2}, "recompute": "full", "token_timesteps": TI2V},
    "ti2v_pp2_vpp2": {"layout": {"pp": 2, "vpp": 2}, "checkpoint": DEEP, "token_timesteps": TI2V},
    "ti2v_dp2_zero1_lora": {"layout": {"zero_stage": 1}, "lora": True, "token_timesteps": TI2V},
}

# bf16 (mm_parallel.precision) against the bf16 single process, to bf16's precision
TWO.update({f"bf16_{name}": {"layout": TWO[name]["layout"], "precision": "bf16", "tolerance": BF16_TOLERANCE}
            for name in ("tp2_sp", "pp2", "ulysses2", "ring2", "dp2_zero1")})

# the Ascend path (fused kernels, native HCCL backend) on its CPU stand-ins against the CPU path
TWO.update(on_stand_ins(TWO, ("tp2_sp", "ulysses2", "ring2", "pp2", "dp2_zero1")))
TWO.update(on_stand_ins(TWO, ("ring2",), "ascend_bf16_", BF16_TOLERANCE))  # bf16 operands, as on Ascend

FOUR = {
    "hybrid2x2": {"layout": {"cp": 4, "cp_algo": "hybrid", "ulysses_degree": 2}},
    "tp2_ulysses2": {"layout": {"tp": 2, "cp": 2}},
    "tp2_sp_pp2": {"layout": {"tp": 2, "sequence_parallel": True, "pp": 2}},
    "pp2_dp2_zero1": {"layout": {"pp": 2, "zero_stage": 1}},
    "pp4": {"layout": {"pp": 4}, "checkpoint": DEEP},
    "lora_pp2_tp2": {"layout": {"pp": 2, "tp": 2}, "lora": True},
    "i2v_ring2_tp2_sp": {"layout": {"cp": 2, "cp_algo": "ring", "tp": 2, "sequence_parallel": True},
                         "checkpoint": I2V},
    "ti2v_hybrid2x2": {"layout": {"cp": 4, "cp_algo": "hybrid", "ulysses_degree": 2}, "token_timesteps": TI2V},
    "ti2v_tp2_sp_pp2": {"layout": {"tp": 2, "sequence_parallel": True, "pp": 2}, "token_timesteps": TI2V},
}
FOUR.update(on_stand_ins(FOUR, ("tp2_ulysses2", "pp2_dp2_zero1")))

FUSED = ("flash_attention_score", "rotary_position_embedding")  # q / k norms split over tp sum over it: not the kernel


def check_stand_in_calls(results, cases):
    """Every stand-in case went through the fused kernels; the calls they made together."""
    return stand_in_calls(results, cases, FUSED)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan_parallel")
    write_adapters(root / "adapters", write_reference(root, **HEADS))
    write_adapters(root / DEEP / "adapters", write_reference(root / DEEP, num_layers=4, **HEADS))
    write_adapters(root / I2V / "adapters", write_reference(root / I2V, i2v=True, **HEADS))
    return root


def test_one_process_on_the_ascend_path_equals_the_cpu_path(checkpoints):
    """The fused kernels (on their stand-ins) in one process, without launching: T2V and I2V
    (image tokens, added k / v), fp32 and bf16."""
    cases = one_process_cases(t2v="", i2v=I2V)
    results = [run_parallel_cases(str(checkpoints), cases)]
    check_results(results, cases)
    check_stand_in_calls(results, cases)


def test_two_process_layouts_equal_single_process(run_distributed, checkpoints):
    results = run_distributed(run_parallel_cases, nproc=2, timeout=600, path=str(checkpoints), cases=TWO)
    check_results(results, TWO)
    assert HCCL_CALLS <= check_stand_in_calls(results, TWO)
    assert RING_CALLS <= set(calls_made(results, TWO)["ascend_ring2"])  # the ring's own blocks


def test_four_process_layouts_equal_single_process(run_distributed, checkpoints):
    results = run_distributed(run_parallel_cases, nproc=4, timeout=900, path=str(checkpoints), cases=FOUR)
    check_results(results, FOUR)
    check_stand_in_calls(results, FOUR)


def test_save_under_layouts_gives_the_original_checkpoint(run_distributed, checkpoints, tmp_path):
    """save_pretrained under tp2+sp / pp2 / pp2 x vpp2 / I2V tp2 writes what was loaded (one file,
    or one per virtual stage plus an index); diffusers loads it; the adapters round-trip in PEFT names."""
    from diffusers import WanTransformer3DModel as Reference
    from helpers.wan_parallel_cases import save_under_layouts

    from mm_parallel.testing.equivalence import saved_folder_problems

    layouts = {"tp2_sp": ({"tp": 2, "sequence_parallel": True}, ""), "pp2": ({"pp": 2}, ""),
               "pp2_vpp2": ({"pp": 2, "vpp": 2}, DEEP), "i2v_tp2": ({"tp": 2}, I2V)}
    results = run_distributed(save_under_layouts, nproc=2, timeout=300, path=str(checkpoints), out=str(tmp_path),
                              layouts=layouts)
    assert all(not problems for result in results for problems in result.values()), results
    for name, (layout, folder) in layouts.items():
        stages = layout.get("pp", 1) * layout.get("vpp", 1)
        assert not saved_folder_problems(str(checkpoints / folder), str(tmp_path / name), stages,
                                         "diffusion_pytorch_model.safetensors"), name
        Reference.from_pretrained(str(tmp_path / name))  # loads without missing or unexpected keys
