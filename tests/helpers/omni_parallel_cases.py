"""The Qwen2.5-Omni thinker under a layout vs one process, inside one msrun launch.

Every case loads the thinker checkpoint with from_pretrained under its topology (the builder of
qwen_vl_parallel_cases picks the class by config.json), applies the plan (recompute, LoRA with
PEFT adapters from ``adapters/``, freezing) and runs two DistributedOptimizer steps on two samples
of audio + image + text, compared with one process by mm_parallel.testing.equivalence.
"""

from __future__ import annotations

import numpy as np
from helpers.omni_reference import AUDIO, AUDIO_END, AUDIO_START, END, IMAGE, START, audio_tokens, features, with_labels
from helpers.qwen_vl_parallel_cases import build, sample_part
from helpers.qwen_vl_parallel_cases import spec as vl_spec
from helpers.qwen_vl_reference import PATCH_DIM, merged

IMAGE_GRID, FRAMES = (1, 4, 8), 30  # 8 image tokens, 7 audio tokens


def batch(seed: int = 0, padded: bool = False):
    """Two samples of one structure (same audio length and image grid), length 32 (divisible by
    2 x cp x tp for every layout here). ``padded``: the second row ends in 3 pads (the collator's
    right padding; for cp cases, whose ranks all see both rows)."""
    rng = np.random.default_rng(seed)
    rows = [rng.integers(3, 240, 3).tolist() + [AUDIO_START] + [AUDIO] * audio_tokens(FRAMES) + [AUDIO_END]
            + rng.integers(3, 240, 2).tolist() + [START] + [IMAGE] * merged(IMAGE_GRID) + [END]
            + rng.integers(3, 240, 8).tolist() for _ in range(2)]
    inputs = {"input_ids": np.array(rows, np.int64), **features([FRAMES, FRAMES], rng),
              "pixel_values": rng.standard_normal((2 * int(np.prod(IMAGE_GRID)), PATCH_DIM)).astype(np.float32),
              "image_grid_thw": np.array([IMAGE_GRID] * 2, np.int64)}
    inputs["attention_mask"] = np.ones_like(inputs["input_ids"])
    if padded:
        inputs["input_ids"][1, -3:], inputs["attention_mask"][1, -3:] = 0, 0
    assert inputs["input_ids"].shape[1] == 32
    return with_labels(inputs)


def omni_part(inputs, index: int, parts: int):
    """Part ``index`` of ``parts`` equal slices of the samples, their images and their audios (one each)."""
    out = sample_part({k: v for k, v in inputs.items() if k not in ("input_features", "feature_attention_mask")},
                      index, parts)
    per = inputs["input_ids"].shape[0] // parts
    for key in ("input_features", "feature_attention_mask"):
        out[key] = inputs[key][index * per:(index + 1) * per]
    return out


def spec():
    from mm_parallel.testing.equivalence import ModelSpec

    return ModelSpec(build=build, split=omni_part, samples=lambda b: b["input_ids"].shape[0], save=vl_spec().save)


def run_parallel_cases(path, cases):
    """cases: {name: {"layout": ParallelConfig kwargs, "recompute", "lora", "freeze", "checkpoint":
    sub-folder of path, "padded": the right-padded batch}} -> mm_parallel.testing.equivalence.run_cases'
    results."""
    from mm_parallel.testing.equivalence import run_cases

    results = {}
    for padded in (False, True):
        group = {name: case for name, case in cases.items() if bool(case.get("padded")) == padded}
        if group:
            results.update(run_cases(spec(), path, group, batch(padded=padded),
                                     reference_key=lambda case: (bool(case.get("lora")),
                                                                 tuple(case.get("freeze", ())))))
    return results


def save_under_layouts(path, out, layouts):
    """layouts: {name: (ParallelConfig kwargs, checkpoint sub-folder)} -> {name: [problems]}
    (mm_parallel.testing.equivalence.save_under_layouts)."""
    from mm_parallel.testing.equivalence import save_under_layouts as save_all

    return save_all(spec(), path, out, layouts)
