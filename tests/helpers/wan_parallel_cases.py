"""Wan's DiT under a layout vs one process, inside one msrun launch.

Every case loads the same diffusers checkpoint with from_pretrained under its topology (each rank
reading its shard), applies the plan (recompute, LoRA with PEFT adapters read from
``path/adapters``), then runs two DistributedOptimizer steps of the flow-matching loss on a batch of
two clips, compared with one process by mm_parallel.testing.equivalence.
"""

from __future__ import annotations

import os

import numpy as np
from helpers.wan_reference import inputs


def batch(i2v: bool = False, token_timesteps: str = ""):
    """Two clips of 4 x 8 x 8 latents: 64 tokens, divisible by 2 x cp x tp for every layout here;
    ``token_timesteps`` "first_frame": Wan2.2 TI2V's per-token timesteps."""
    return inputs(np.random.default_rng(1), i2v=i2v, batch=2, frames=4, size=(8, 8), text_len=8, image_len=4,
                  token_timesteps=token_timesteps)


def sample_part(batch, index: int, parts: int):
    per = batch["hidden_states"].shape[0] // parts
    return {k: v[index * per:(index + 1) * per] for k, v in batch.items()}


def build(path, topo, case):
    """This rank's model chunks, loaded and planned (dit_cases.build_chunks)."""
    from helpers.dit_cases import build_chunks

    from mm_models_video import WanTransformer3DModel
    from mm_models_video.wan import parallel_plan

    return build_chunks(WanTransformer3DModel, parallel_plan, path, topo, case)


def _save(chunks, folder):
    from mm_models_video.wan.parallel_plan import LoraConfig

    chunks[0].save_pretrained(folder, chunks)
    chunks[0].save_adapter(os.path.join(folder, "adapters"), LoraConfig(r=4, alpha=8.0), chunks)


def spec():
    from mm_parallel.testing.equivalence import ModelSpec

    return ModelSpec(build=build, split=sample_part, samples=lambda b: b["hidden_states"].shape[0], save=_save)


def save_under_layouts(path, out, layouts):
    """layouts: {name: (ParallelConfig kwargs, checkpoint sub-folder)} -> {name: [problems]}."""
    from mm_parallel.testing.equivalence import save_under_layouts as save_all

    return save_all(spec(), path, out, layouts)


def run_parallel_cases(path, cases):
    """cases: {name: {"layout": ParallelConfig kwargs, "recompute", "lora", "checkpoint": sub-folder
    of path ("i2v" for the I2V model), "token_timesteps"}} -> mm_parallel.testing.equivalence.run_cases'
    results."""
    from mm_parallel.testing.equivalence import run_cases

    spec_ = spec()
    results = {}
    kinds = sorted({(c.get("checkpoint", "").startswith("i2v"), c.get("token_timesteps", "")) for c in cases.values()})
    for i2v, timesteps in kinds:
        group = {k: v for k, v in cases.items()
                 if (v.get("checkpoint", "").startswith("i2v"), v.get("token_timesteps", "")) == (i2v, timesteps)}
        results.update(run_cases(spec_, path, group, batch(i2v, timesteps),
                                 reference_key=lambda c: (bool(c.get("lora")),)))
    return results
