"""CogVideoX's transformer under a layout vs one process, inside one msrun launch.

Every case loads the same diffusers checkpoint with from_pretrained under its topology, applies
the plan (recompute, LoRA with PEFT adapters from ``<checkpoint>/adapters``), then runs two
DistributedOptimizer steps of the loss on two clips with the pipeline's rotary tables, compared
with one process by mm_parallel.testing.equivalence.
"""

from __future__ import annotations

import os

import numpy as np
from helpers.cogvideox_reference import inputs

# latents per checkpoint kind: 8 text + 48 (1.0: 3 frames of 4 x 4 patches) or 32 (1.5: 2 x 4 x 4)
# joint tokens, divisible by 2 x ring x ulysses x sp-tp = 8 for every layout here
FRAMES = {"1.0-t2v": 3, "1.5-i2v": 4}
SHARED = ("image_rotary_emb", "ofs")  # one for the whole batch: not cut into samples


def batch(kind: str, config, text_rows: int = 8):
    from mm_models_video.cogvideox import rotary_tables

    frames = FRAMES[kind]
    out = inputs(np.random.default_rng(1), kind, batch=2, frames=frames, size=(8, 8), text_len=text_rows)
    out["image_rotary_emb"] = rotary_tables(config, frames, 8, 8)
    return out


def sample_part(batch, index: int, parts: int):
    per = batch["hidden_states"].shape[0] // parts
    return {k: v if k in SHARED else v[index * per:(index + 1) * per] for k, v in batch.items()}


def build(path, topo, case):
    """This rank's model chunks, loaded and planned (dit_cases.build_chunks)."""
    from helpers.dit_cases import build_chunks

    from mm_models_video import CogVideoXTransformer3DModel
    from mm_models_video.cogvideox import parallel_plan

    return build_chunks(CogVideoXTransformer3DModel, parallel_plan, path, topo, case)


def spec():
    from mm_parallel.testing.equivalence import ModelSpec

    return ModelSpec(build=build, split=sample_part, samples=lambda b: b["hidden_states"].shape[0])


def run_parallel_cases(path, cases):
    """cases: {name: {"layout": ParallelConfig kwargs, "recompute", "lora", "checkpoint": sub-folder
    of path (a kind of FRAMES), "text_rows" (default 8; 7 leaves a joint length the layout pads)}}
    -> mm_parallel.testing.equivalence.run_cases' results."""
    from mm_models_video import CogVideoXTransformerConfig
    from mm_parallel.testing.equivalence import run_cases

    results = {}
    for kind in FRAMES:
        for text_rows in sorted({c.get("text_rows", 8) for c in cases.values()}):
            group = {k: v for k, v in cases.items()
                     if v["checkpoint"].split("/")[0] == kind and v.get("text_rows", 8) == text_rows}
            if group:
                config = CogVideoXTransformerConfig.load(os.path.join(path, kind))
                results.update(run_cases(spec(), path, group, batch(kind, config, text_rows),
                                         reference_key=lambda c: (bool(c.get("lora")),)))
    return results
