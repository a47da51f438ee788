"""The Omni thinker's analytic FLOPs equal an independent count: torch's FlopCounterMode over
transformers' thinker (every matmul, bmm and convolution it runs), forward only."""

import numpy as np
import pytest
import torch  # noqa: F401  (the parity reference: required, see tests/conftest.py)
from helpers.omni_reference import audio_placeholder, features, sample, tiny_config, with_labels


def _count(model, inputs):
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(**{k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in inputs.items()})
    return counter.get_total_flops()


def _two_audios(rng):
    """Two unpadded rows of one length whose audios differ (37 and 22 frames: chunks of 8 frames
    padded to the batch's longest in the stem)."""
    rows = [rng.integers(3, 240, 2).tolist() + audio_placeholder(n) for n in (37, 22)]
    length = max(map(len, rows)) + 2
    ids = np.array([row + rng.integers(3, 240, length - len(row)).tolist() for row in rows], np.int64)
    return with_labels({"input_ids": ids, "attention_mask": np.ones_like(ids), **features([37, 22], rng)})


@pytest.mark.parametrize("case", ["text", "audio", "image_audio_video", "audio_in_video", "two_audios"])
def test_omni_flops_equal_torch_flop_counter(case):
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration as Reference

    from mm_models_vl.qwen2_5_omni.flops import batch_flops

    torch.manual_seed(0)
    model = Reference(tiny_config()).eval()
    rng = np.random.default_rng(0)
    inputs = _two_audios(rng) if case == "two_audios" else sample(case, rng)
    inputs.pop("labels")
    expected = _count(model, inputs)
    assert batch_flops(model.config, inputs) * len(inputs["input_ids"]) == pytest.approx(expected, rel=1e-12)
