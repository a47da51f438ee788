"""One Wan2.1 DiT flow-matching train step (forward, backward, AdamW), ours vs diffusers on torch CPU.

    python benchmarks/step_time_wan.py [--runs 5] [--threads 2] [--frames 8]

Same config for both (dim 512 = 4 heads x 128, 4 blocks, FFN 2048, text_dim 4096, freq_dim 256),
latents 16 x 8 x 32 x 32 (patch 1 x 2 x 2: 2,048 video tokens; --frames sets the 8), 64 text tokens, same random
weights (diffusers saves them, ours loads them with from_pretrained), same inputs, same thread
count, same update (global-norm clipping at 1.0, then AdamW). Each side takes a warm-up step,
then ``--runs`` steps alternate between the two; the table prints each side's median, the floor
(the step's FLOPs over MindSpore's matmul rate measured in the same run), the ratios ours / floor
(goal <= 1.3) and ours / torch (goal <= 1.4) and, for ours, where the time goes (forward,
backward, optimizer).
"""

from __future__ import annotations

import sys

import numpy as np
from _timing import our_train_step, torch_video_step, video_benchmark_main

GOALS = {"floor": 1.3, "torch": 1.4}
CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=128, in_channels=16, out_channels=16,
              text_dim=4096, freq_dim=256, ffn_dim=2048, num_layers=4, cross_attn_norm=True,
              qk_norm="rms_norm_across_heads", eps=1e-6)


def inputs(frames: int = 8):
    rng = np.random.default_rng(0)
    noise, clean = (rng.standard_normal((1, 16, frames, 32, 32)).astype(np.float32) for _ in range(2))
    sigma = np.float32(0.6)
    return {"hidden_states": (1 - sigma) * clean + sigma * noise, "timestep": np.array([sigma * 1000], np.float32),
            "encoder_hidden_states": rng.standard_normal((1, 64, 4096)).astype(np.float32),
            "target": noise - clean}


def torch_side(path, threads):
    import torch
    from diffusers import WanTransformer3DModel

    return torch_video_step(lambda: WanTransformer3DModel(**CONFIG), path, threads,
                            lambda batch: {k: torch.from_numpy(v) for k, v in batch.items() if k != "target"})


def our_side(path, precision: str = "fp32"):
    from mm_models_video import WanTransformer3DModel

    return our_train_step(WanTransformer3DModel.from_pretrained(path), precision)


def floor(config, batch):
    """(forward FLOPs, the FFN's matmul shape: video tokens x dim x ffn_dim)."""
    from mm_models_video.wan.flops import batch_flops

    _, _, frames, height, width = batch["hidden_states"].shape
    pt, ph, pw = config["patch_size"]
    tokens = frames // pt * (height // ph) * (width // pw)
    return batch_flops(config, batch), (tokens, config["num_attention_heads"] * config["attention_head_dim"],
                                        config["ffn_dim"])


def main():
    return video_benchmark_main(__doc__, inputs, torch_side, our_side, lambda args: (
        f"Wan2.1 DiT flow-matching train step, {args.frames * 256} video + 64 text tokens, dim 512, "
        f"4 blocks, {args.threads} threads"), floor, GOALS)


if __name__ == "__main__":
    sys.exit(main())
