"""CogVideoX's transformer under a layout vs one process, inside one msrun launch.

Every case loads the same diffusers checkpoint with from_pretrained under its topology, applies
the plan (recompute, LoRA with PEFT adapters from ``<checkpoint>/adapters``), then runs two
DistributedOptimizer steps of the loss on two clips with the pipeline's rotary tables, compared
with one process by mm_parallel.testing.equivalence.
"""

from __future__ import annotations

import os

import numpy as np
from cogvideox_reference import inputs

# latents per checkpoint kind: 8 text + 48 (1.0: 3 frames of 4 x 4 patches) or 32 (1.5: 2 x 4 x 4)
# joint tokens, divisible by 2 x ring x ulysses x sp-tp = 8 for every layout here
FRAMES = {"1.0-t2v": 3, "1.5-i2v": 4}
SHARED = ("image_rotary_emb", "ofs")  # one for the whole batch: not cut into samples


def batch(kind: str, config):
    from mm_models_video.cogvideox import rotary_tables

    frames = FRAMES[kind]
    out = inputs(np.random.default_rng(1), kind, batch=2, frames=frames, size=(8, 8), text_len=8)
    out["image_rotary_emb"] = rotary_tables(config, frames, 8, 8)
    return out


def sample_part(batch, index: int, parts: int):
    per = batch["hidden_states"].shape[0] // parts
    return {k: v if k in SHARED else v[index * per:(index + 1) * per] for k, v in batch.items()}


def build(path, topo, case):
    """This rank's model chunks, loaded and planned (dit_cases.build_chunks)."""
    from dit_cases import build_chunks

    from mm_models_video import CogVideoXTransformer3DModel
    from mm_models_video.cogvideox import parallel_plan

    return build_chunks(CogVideoXTransformer3DModel, parallel_plan, path, topo, case)


def spec():
    from mm_parallel.testing.equivalence import ModelSpec

    return ModelSpec(build=build, split=sample_part, samples=lambda b: b["hidden_states"].shape[0])


def run_parallel_cases(path, cases):
    """cases: {name: {"layout": ParallelConfig kwargs, "recompute", "lora", "checkpoint": sub-folder
    of path (a kind of FRAMES)}} -> mm_parallel.testing.equivalence.run_cases' results."""
    from mm_models_video import CogVideoXTransformerConfig
    from mm_parallel.testing.equivalence import run_cases

    results = {}
    for kind in FRAMES:
        group = {k: v for k, v in cases.items() if v["checkpoint"].split("/")[0] == kind}
        if group:
            config = CogVideoXTransformerConfig.load(os.path.join(path, kind))
            results.update(run_cases(spec(), path, group, batch(kind, config),
                                     reference_key=lambda c: (bool(c.get("lora")),)))
    return results
