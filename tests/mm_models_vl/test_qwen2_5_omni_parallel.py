"""The Qwen2.5-Omni thinker loaded with from_pretrained under a layout trains like one process: two
DistributedOptimizer steps, losses, first-step gathered gradients (audio and vision towers
included) and final parameters (rel-err <= 1e-4; losses rtol 1e-5), on samples with an audio and
an image. See omni_parallel_cases.py."""

import pytest
import torch  # noqa: F401  (the parity reference: required, see tests/conftest.py)
from helpers.device_path_cases import one_process_cases
from helpers.omni_parallel_cases import run_parallel_cases
from helpers.omni_reference import write_reference
from helpers.qwen_vl_reference import LORA_TARGETS

from mm_parallel.testing.device_path import RING_CALLS, calls_made, check_stand_in_calls, on_stand_ins
from mm_parallel.testing.equivalence import BF16_TOLERANCE, check_results

pytestmark = pytest.mark.distributed

DEEP = "deep"  # a 4-layer checkpoint, for pp2 x vpp2

TWO = {
    "tp2_sp": {"layout": {"tp": 2, "sequence_parallel": True}},
    "ulysses2": {"layout": {"cp": 2}},
    "ring2": {"layout": {"cp": 2, "cp_algo": "ring"}},
    "dp2_zero1": {"layout": {"zero_stage": 1}},
    "pp2": {"layout": {"pp": 2}, "freeze": ("audio", "vision", "merger")},  # both towers' outputs kept
    "pp2_vpp2": {"layout": {"pp": 2, "vpp": 2}, "checkpoint": DEEP},
    "lora_tp2": {"layout": {"tp": 2}, "lora": True},
    "tp2_sp_recompute_full": {"layout": {"tp": 2, "sequence_parallel": True}, "recompute": "full"},
    "tp2_frozen_audio_vision": {"layout": {"tp": 2}, "freeze": ("audio", "vision")},
    # a right-padded row: its mask sets the positions, then causal attention under cp does without it
    "ulysses2_padded": {"layout": {"cp": 2}, "padded": True},
    "ring2_padded": {"layout": {"cp": 2, "cp_algo": "ring"}, "padded": True},
}

# the Ascend path on its stand-ins: the audio tower's chunks and the vision windows as padded
# batches for the kernel, the ring's kernel blocks over a padded row; bf16 with bf16 operands
TWO.update(on_stand_ins(TWO, ("tp2_sp", "ring2_padded")))
TWO.update(on_stand_ins(TWO, ("ulysses2_padded",), "ascend_bf16_", BF16_TOLERANCE))
FUSED = ("flash_attention_score", "rms_norm", "rotary_position_embedding", "swiglu")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from helpers.torch_reference import write_peft_adapters

    root = tmp_path_factory.mktemp("omni_parallel")
    write_peft_adapters(root / "adapters", write_reference(root), LORA_TARGETS)
    write_peft_adapters(root / DEEP / "adapters", write_reference(root / DEEP, num_hidden_layers=4), LORA_TARGETS)
    return root


def test_one_process_on_the_ascend_path_equals_the_cpu_path(checkpoints):
    """The thinker (audio and vision towers) on the stand-ins in one process, fp32 and bf16."""
    cases = one_process_cases(thinker="")
    results = [run_parallel_cases(str(checkpoints), cases)]
    check_results(results, cases)
    check_stand_in_calls(results, cases, FUSED)


def test_two_process_layouts_equal_single_process(run_distributed, checkpoints):
    results = run_distributed(run_parallel_cases, nproc=2, timeout=600, path=str(checkpoints), cases=TWO)
    check_results(results, TWO)
    check_stand_in_calls(results, TWO, FUSED)
    assert RING_CALLS <= set(calls_made(results, TWO)["ascend_ring2_padded"])  # the ring's own blocks


def test_save_under_layouts_gives_the_original_checkpoint(run_distributed, checkpoints, tmp_path):
    """save_pretrained under tp2 / pp2 x vpp2 writes the thinker that was loaded (one file, or one
    per virtual stage plus an index) and transformers' thinker class loads it; the adapters, audio
    encoder's included, round-trip in PEFT names."""
    from helpers.omni_parallel_cases import save_under_layouts
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration as Reference

    from mm_parallel.testing.equivalence import saved_folder_problems

    layouts = {"tp2": ({"tp": 2}, ""), "pp2_vpp2": ({"pp": 2, "vpp": 2}, DEEP)}
    results = run_distributed(save_under_layouts, nproc=2, timeout=300, path=str(checkpoints), out=str(tmp_path),
                              layouts=layouts)
    assert all(not problems for result in results for problems in result.values()), results
    for name, (layout, folder) in layouts.items():
        stages = layout.get("pp", 1) * layout.get("vpp", 1)
        assert not saved_folder_problems(str(checkpoints / folder), str(tmp_path / name), stages,
                                         "model.safetensors"), name
        Reference.from_pretrained(str(tmp_path / name))  # loads without missing or unexpected keys


def test_decoding_under_a_pipeline_equals_one_process(run_distributed, checkpoints):
    """The thinker's prompts decoded with each stage's cache (tests/helpers/decoding_cases.py)."""
    from helpers.decoding_cases import check_layouts_decode_alike

    check_layouts_decode_alike(run_distributed, 2, checkpoints, {"decode_pp2": {"layout": {"pp": 2}}}, "qwen2_5_omni")
