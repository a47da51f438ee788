"""Qwen2.5-VL loaded with from_pretrained under a layout trains like one process: two
DistributedOptimizer steps, losses, first-step gathered gradients and final parameters
(rel-err <= 1e-4; losses rtol 1e-5). Pipeline stages compare the parameters they hold; together
they must cover the whole model. See qwen_vl_parallel_cases.py.
The bf16_* cases run in bf16 (mm_parallel.precision) against the bf16 single process, within
mm_parallel.testing.equivalence.BF16_TOLERANCE."""

import pytest
import torch  # noqa: F401  (the parity reference: required, see tests/conftest.py)
from helpers.device_path_cases import one_process_cases
from helpers.qwen_vl_parallel_cases import run_parallel_cases
from helpers.qwen_vl_reference import write_adapters, write_reference

from mm_parallel.testing.device_path import HCCL_CALLS, RING_CALLS, calls_made, on_stand_ins
from mm_parallel.testing.device_path import check_stand_in_calls as stand_in_calls
from mm_parallel.testing.equivalence import BF16_TOLERANCE, check_results

pytestmark = pytest.mark.distributed

DEEP = "deep"  # a 4-layer checkpoint, for pipelines with more virtual stages than 2

TWO = {
    "tp2": {"layout": {"tp": 2}},
    "tp2_sp": {"layout": {"tp": 2, "sequence_parallel": True}},
    "ulysses2": {"layout": {"cp": 2}},
    "ring2": {"layout": {"cp": 2, "cp_algo": "ring"}},
    "dp2_zero1": {"layout": {"zero_stage": 1}},
    # the tower and merger frozen: stage 0 keeps their output for its backward's second forward
    "pp2": {"layout": {"pp": 2}, "freeze": ("vision", "merger")},
    "pp2_vpp2": {"layout": {"pp": 2, "vpp": 2}, "checkpoint": DEEP},
    "lora_tp2": {"layout": {"tp": 2}, "lora": True},
    "tp2_sp_recompute_full": {"layout": {"tp": 2, "sequence_parallel": True}, "recompute": "full"},
    "ring2_recompute_selective": {"layout": {"cp": 2, "cp_algo": "ring"}, "recompute": "selective"},
    "ulysses2_recompute_block": {"layout": {"cp": 2}, "recompute": "block"},
    "tp2_frozen_vision": {"layout": {"tp": 2}, "freeze": ("vision",)},
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
}
FOUR.update(on_stand_ins(FOUR, ("tp2_ulysses2", "pp2_dp2_zero1")))

FUSED = ("flash_attention_score", "rms_norm", "rotary_position_embedding", "swiglu")


def check_stand_in_calls(results, cases):
    """Every stand-in case went through the fused kernels; the calls they made together."""
    return stand_in_calls(results, cases, FUSED)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_parallel")
    write_adapters(root / "adapters", write_reference(root))
    write_adapters(root / DEEP / "adapters", write_reference(root / DEEP, num_hidden_layers=4))
    return root


def test_one_process_on_the_ascend_path_equals_the_cpu_path(checkpoints):
    """The fused kernels (on their stand-ins) in one process, without launching: fp32 and bf16."""
    cases = one_process_cases(model="")
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


# DPO's loss (mm_parallel.preference.PairedBatch as `preference`) on two pairs: each sequence's
# log-probs with the vocabulary over tp, the sequence over cp, pairs as pipeline micro-batches and
# over dp
DPO = {"dpo_tp2_sp": {"layout": {"tp": 2, "sequence_parallel": True}}, "dpo_ulysses2": {"layout": {"cp": 2}},
       "dpo_ring2": {"layout": {"cp": 2, "cp_algo": "ring"}}, "dpo_pp2": {"layout": {"pp": 2}},
       "dpo_dp2_zero1": {"layout": {"zero_stage": 1}}}


def test_dpo_layouts_equal_single_process(run_distributed, checkpoints):
    from helpers.qwen_vl_parallel_cases import run_dpo_cases

    results = run_distributed(run_dpo_cases, nproc=2, timeout=600, path=str(checkpoints), cases=DPO)
    assert all(result.pop("dpo_losses") > 0 for result in results)
    check_results(results, DPO)


# GRPO's loss (mm_parallel.grpo.PolicyBatch as `preference`) on two prompts' completions, the same
# rollouts under each layout: per-token ratios, clipping and the KL with the vocabulary over tp, the
# sequence over cp, completions as pipeline micro-batches (pp2 x vpp2), over dp with ZeRO-1, under
# LoRA and in bf16
GRPO = {"grpo_tp2_sp": {"layout": {"tp": 2, "sequence_parallel": True}},
        "grpo_ring2": {"layout": {"cp": 2, "cp_algo": "ring"}},
        "grpo_pp2_vpp2": {"layout": {"pp": 2, "vpp": 2}, "checkpoint": DEEP},
        "grpo_lora_dp2_zero1": {"layout": {"zero_stage": 1}, "lora": True},
        "grpo_bf16_tp2": {"layout": {"tp": 2}, "precision": "bf16", "tolerance": BF16_TOLERANCE}}


def test_grpo_layouts_equal_single_process(run_distributed, checkpoints):
    from helpers.qwen_vl_parallel_cases import run_grpo_cases

    results = run_distributed(run_grpo_cases, nproc=2, timeout=600, path=str(checkpoints), cases=GRPO)
    assert all(result.pop("grpo_losses") > 0 for result in results)
    check_results(results, GRPO)


def test_save_under_layouts_gives_the_original_checkpoint(run_distributed, checkpoints, tmp_path):
    """save_pretrained under tp2 / pp2 / pp2 x vpp2 writes what was loaded (one file, or one per
    virtual stage plus an index); transformers loads it; the adapters round-trip in PEFT names."""
    from helpers.qwen_vl_parallel_cases import save_under_layouts
    from transformers import Qwen2_5_VLForConditionalGeneration as Reference

    from mm_parallel.testing.equivalence import saved_folder_problems

    layouts = {"tp2": ({"tp": 2}, ""), "pp2": ({"pp": 2}, ""), "pp2_vpp2": ({"pp": 2, "vpp": 2}, DEEP)}
    results = run_distributed(save_under_layouts, nproc=2, timeout=300, path=str(checkpoints), out=str(tmp_path),
                              layouts=layouts)
    assert all(not problems for result in results for problems in result.values()), results
    for name, (layout, folder) in layouts.items():
        stages = layout.get("pp", 1) * layout.get("vpp", 1)
        assert not saved_folder_problems(str(checkpoints / folder), str(tmp_path / name), stages,
                                         "model.safetensors"), name
        Reference.from_pretrained(str(tmp_path / name))  # loads without missing or unexpected keys



def test_a_device_path_step_reads_the_host_only_for_the_loss(checkpoints):
    """On the Ascend path (stand-ins) a Qwen2.5-VL training step's forward and backward and its
    optimizer step (clipping on) read nothing from the device but the loss this harness reads
    (mm-train's loop defers that one too: tests/mm_train/test_device_path_run.py)."""
    from helpers.qwen_vl_parallel_cases import batch, spec

    from mm_parallel import ParallelConfig
    from mm_parallel.optimizer import DistributedOptimizer, OptimizerConfig
    from mm_parallel.testing.device_path import ascend_stand_ins
    from mm_parallel.testing.equivalence import loss_and_grads
    from mm_parallel.testing.host_transfers import host_transfers
    from mm_parallel.topology import Topology

    topo = Topology.build(ParallelConfig(), 1, 0)
    model_spec, data = spec(), batch()
    chunks = model_spec.build(str(checkpoints), topo, {})
    optimizer = DistributedOptimizer(chunks[0], OptimizerConfig(lr=1e-3, clip_grad=1.0), topo)
    with ascend_stand_ins():
        for _ in range(2):  # the second step: nothing left to set up
            with host_transfers() as step:
                _, grads = loss_and_grads(model_spec, chunks, topo, data)
                forward_backward = step.reads
                optimizer.step(grads)
    assert forward_backward == 1 and step.reads == 1, step.sites()
    # uploads: the step's input data only (ids, pixels, positions and rotary tables, gather orders,
    # targets, made from the host batch; the vision windows' segments as a batch for the kernel),
    # and ops.gelu's own scalar
    uploaded = {site.split(":")[0] for site in step.sites() if site.endswith(" upload")}
    assert uploaded <= {"mm_models_vl/qwen2_5_vl/modeling.py", "mm_models_vl/qwen2_5_vl/vision.py",
                        "mm_parallel/ops/fused_attention.py", "mm_parallel/ops/activations.py"}, step.sites()
    reads = [site.split(":")[0] for site in step.sites() if not site.endswith(" upload")]
    assert reads == ["mm_parallel/testing/equivalence.py"], step.sites()
    assert not [site for site in step.sites() if site.startswith("mm_parallel/optimizer.py")], step.sites()


# Decoding (mm_parallel.decoding: rollouts, samples, generate) under a layout: the key/value cache
# per pipeline stage, the sequence whole under cp / sp, ZeRO-3's gathers and dp ranks whose rows
# stop at different steps (tests/helpers/decoding_cases.py)
DECODE_TWO = {"decode_tp2": {"layout": {"tp": 2}}, "decode_tp2_sp": {"layout": {"tp": 2, "sequence_parallel": True}},
              "decode_ring2": {"layout": {"cp": 2, "cp_algo": "ring"}}, "decode_ulysses2": {"layout": {"cp": 2}},
              "decode_pp2": {"layout": {"pp": 2}},
              "decode_pp2_vpp2": {"layout": {"pp": 2, "vpp": 2}, "checkpoint": DEEP},
              "decode_dp2_zero3": {"layout": {"zero_stage": 3, "zero3_min_numel": 1}},
              "decode_ascend_pp2": {"layout": {"pp": 2}, "device": "ascend_stand_ins"}}
DECODE_FOUR = {"decode_tp2_sp_pp2": {"layout": {"tp": 2, "sequence_parallel": True, "pp": 2}},
               "decode_hybrid2x2": {"layout": {"cp": 4, "cp_algo": "hybrid", "ulysses_degree": 2}},
               "decode_pp2_dp2_zero3": {"layout": {"pp": 2, "zero_stage": 3, "zero3_min_numel": 1}}}


@pytest.mark.parametrize("nproc,cases", [(2, DECODE_TWO), (4, DECODE_FOUR)], ids=["two", "four"])
def test_decoding_under_layouts_equals_one_process(run_distributed, checkpoints, nproc, cases):
    from helpers.decoding_cases import check_layouts_decode_alike

    check_layouts_decode_alike(run_distributed, nproc, checkpoints, cases, "qwen2_5_vl")
