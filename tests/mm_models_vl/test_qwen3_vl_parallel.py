"""Qwen3-VL and Qwen3-VL-MoE loaded with from_pretrained under a layout train like one process: two
DistributedOptimizer steps, losses, first-step gathered gradients and final parameters (rel-err
<= 1e-4; losses rtol 1e-5), on samples with an image and a video (so DeepStack features flow).
Under pipeline parallelism the DeepStack levels and the MoE statistics cross stages: the 4-layer
checkpoint puts one layer on each of 4 virtual stages. See qwen3_vl_parallel_cases.py."""

import pytest
from helpers.device_path_cases import one_process_cases
from helpers.qwen3_vl_parallel_cases import run_parallel_cases
from helpers.qwen3_vl_reference import write_reference
from helpers.qwen_vl_reference import write_adapters

from mm_parallel.testing.device_path import RING_CALLS, calls_made, check_stand_in_calls, on_stand_ins
from mm_parallel.testing.equivalence import BF16_TOLERANCE, check_results

pytestmark = pytest.mark.distributed

DEEP, MOE = "deep", "moe"  # a 4-layer dense checkpoint; a 3-layer MoE one (layers 0 and 2 sparse)

TWO = {
    "tp2": {"layout": {"tp": 2}},
    "tp2_sp": {"layout": {"tp": 2, "sequence_parallel": True}},
    "ulysses2": {"layout": {"cp": 2}},
    "ring2": {"layout": {"cp": 2, "cp_algo": "ring"}},
    "dp2_zero1": {"layout": {"zero_stage": 1}},
    "pp2": {"layout": {"pp": 2}, "pipeline_num_layers": [1, 2],  # DeepStack level 1 crosses
            "freeze": ("vision", "merger")},  # the frozen tower's output (and DeepStack's) kept for the backward
    "pp2_vpp2": {"layout": {"pp": 2, "vpp": 2}, "checkpoint": DEEP},
    "lora_tp2": {"layout": {"tp": 2}, "lora": True},
    "tp2_frozen_vision": {"layout": {"tp": 2}, "freeze": ("vision",)},
    "tp2_sp_recompute_full": {"layout": {"tp": 2, "sequence_parallel": True}, "recompute": "full"},
    "moe_ep2": {"layout": {"ep": 2}, "checkpoint": MOE},
    "moe_lora_ep2": {"layout": {"ep": 2}, "checkpoint": MOE, "lora": True},  # attention and the dense layer
    "moe_tp2_sp": {"layout": {"tp": 2, "sequence_parallel": True}, "checkpoint": MOE},
    "moe_ep2_recompute_full": {"layout": {"ep": 2}, "checkpoint": MOE, "recompute": "full"},
    "moe_tp2_sp_recompute_selective": {"layout": {"tp": 2, "sequence_parallel": True}, "checkpoint": MOE,
                                       "recompute": "selective"},
    "moe_pp2_zero2": {"layout": {"pp": 2, "zero_stage": 2}, "checkpoint": MOE, "pipeline_num_layers": [1, 2]},
}

# the Ascend path on its stand-ins: the ring's kernel blocks, the experts' grouped_matmul and swiglu
# over expert parallelism; in bf16 the kernels take bf16 operands, as on Ascend
TWO.update(on_stand_ins(TWO, ("ring2", "moe_ep2")))
TWO.update(on_stand_ins(TWO, ("moe_ep2",), "ascend_bf16_", BF16_TOLERANCE))
FUSED = ("flash_attention_score", "rms_norm", "rotary_position_embedding", "swiglu")

FOUR = {
    "hybrid2x2": {"layout": {"cp": 4, "cp_algo": "hybrid", "ulysses_degree": 2}},
    "pp4": {"layout": {"pp": 4}, "checkpoint": DEEP},
    "tp2_sp_pp2": {"layout": {"tp": 2, "sequence_parallel": True, "pp": 2}, "pipeline_num_layers": [1, 2]},
    "moe_ep2_tp2": {"layout": {"ep": 2, "tp": 2}, "checkpoint": MOE},
    "moe_ep2_pp2": {"layout": {"ep": 2, "pp": 2}, "checkpoint": MOE, "pipeline_num_layers": [2, 1]},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_parallel")
    write_adapters(root / "adapters", write_reference(root))
    write_reference(root / DEEP, num_hidden_layers=4)
    write_adapters(root / MOE / "adapters", write_reference(root / MOE, moe=True))
    return root


def test_one_process_on_the_ascend_path_equals_the_cpu_path(checkpoints):
    """Dense and MoE (the experts' grouped_matmul and swiglu inside the model) on the stand-ins in
    one process, without launching, in fp32 and bf16."""
    cases = one_process_cases(dense="", moe=MOE)
    results = [run_parallel_cases(str(checkpoints), cases)]
    check_results(results, cases)
    check_stand_in_calls(results, cases, FUSED)
    assert all("grouped_matmul" in calls for name, calls in calls_made(results, cases).items() if "moe" in name)


def test_two_process_layouts_equal_single_process(run_distributed, checkpoints):
    results = run_distributed(run_parallel_cases, nproc=2, timeout=900, path=str(checkpoints), cases=TWO)
    check_results(results, TWO)
    check_stand_in_calls(results, TWO, FUSED)
    made = calls_made(results, TWO)
    assert RING_CALLS <= set(made["ascend_ring2"])  # the ring's own blocks
    for name in ("ascend_moe_ep2", "ascend_bf16_moe_ep2"):  # tokens to their experts' ranks and back
        assert {"grouped_matmul", "all_to_all_single"} <= set(made[name]), (name, made[name])


def test_four_process_layouts_equal_single_process(run_distributed, checkpoints):
    check_results(run_distributed(run_parallel_cases, nproc=4, timeout=900, path=str(checkpoints), cases=FOUR), FOUR)


# Decoding under a layout (tests/helpers/decoding_cases.py): the MoE layers' token layout made whole
# under sp, experts exchanged over ep by dp ranks whose rows stop at different steps, DeepStack
# features and caches across pipeline stages
DECODE = {2: {"decode_moe_tp2_sp": {"layout": {"tp": 2, "sequence_parallel": True}, "checkpoint": MOE}},
          4: {"decode_moe_ep2_pp2": {"layout": {"ep": 2, "pp": 2}, "checkpoint": MOE, "pipeline_num_layers": [2, 1]}}}


@pytest.mark.parametrize("nproc", [2, 4])
def test_decoding_under_layouts_equals_one_process(run_distributed, checkpoints, nproc):
    from helpers.decoding_cases import check_layouts_decode_alike

    check_layouts_decode_alike(run_distributed, nproc, checkpoints, DECODE[nproc], "qwen3_vl")
