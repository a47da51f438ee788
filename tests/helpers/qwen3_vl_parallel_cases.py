"""Qwen3-VL and Qwen3-VL-MoE under a layout vs one process, inside one msrun launch.

Every case loads a transformers checkpoint (dense or MoE, by its config.json) with
from_pretrained under its topology, applies the plan (recompute, LoRA with PEFT adapters from
``adapters/``, freezing) and runs two DistributedOptimizer steps on two samples of image + video +
text, compared with one process by mm_parallel.testing.equivalence. The loss is the mean of the
samples' losses (each with its own load-balancing term, as a micro-batch of one under pp).
"""

from __future__ import annotations

import numpy as np
from helpers.qwen3_vl_reference import IMAGE, PATCH_DIM, merged, placeholder, video_placeholders, with_types_and_labels
from helpers.qwen_vl_parallel_cases import build, sample_part

IMAGE_GRID, VIDEO_GRID = (1, 4, 8), (2, 4, 4)


def batch(seed: int = 0):
    """Two samples of one structure, length 40 (divisible by 2 x cp x tp for every layout here)."""
    rng = np.random.default_rng(seed)
    rows = [rng.integers(3, 240, 3).tolist() + placeholder(IMAGE, merged(IMAGE_GRID)) + rng.integers(3, 240, 2).tolist()
            + video_placeholders(VIDEO_GRID, rng) + rng.integers(3, 240, 9).tolist() for _ in range(2)]
    inputs = {"input_ids": np.array(rows, np.int64),
              "pixel_values": rng.standard_normal((2 * int(np.prod(IMAGE_GRID)), PATCH_DIM)).astype(np.float32),
              "image_grid_thw": np.array([IMAGE_GRID] * 2, np.int64),
              "pixel_values_videos": rng.standard_normal((2 * int(np.prod(VIDEO_GRID)), PATCH_DIM)).astype(np.float32),
              "video_grid_thw": np.array([VIDEO_GRID] * 2, np.int64)}
    assert inputs["input_ids"].shape[1] == 40
    return with_types_and_labels(inputs)


def per_sample_loss(model, inputs):
    samples = inputs["input_ids"].shape[0]
    return sum(model(**sample_part(inputs, i, samples)).loss for i in range(samples)) / samples


def spec():
    from mm_parallel.testing.equivalence import ModelSpec

    return ModelSpec(build=build, split=sample_part, samples=lambda b: b["input_ids"].shape[0], loss=per_sample_loss)


def run_parallel_cases(path, cases):
    """cases: {name: {"layout": ParallelConfig kwargs, "recompute", "lora", "freeze", "checkpoint":
    sub-folder of path}} -> mm_parallel.testing.equivalence.run_cases' results."""
    from mm_parallel.testing.equivalence import run_cases

    return run_cases(spec(), path, cases, batch(),
                     reference_key=lambda case: (bool(case.get("lora")), tuple(case.get("freeze", ()))))
