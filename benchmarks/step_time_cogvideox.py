"""One CogVideoX transformer v-prediction train step (forward, backward, AdamW), ours vs diffusers
on torch CPU.

    python benchmarks/step_time_cogvideox.py [--runs 5] [--threads 2] [--frames 8]

Same config for both (dim 512 = 8 heads x 64, 4 blocks, text_embed_dim 4096, time_embed_dim
512, CogVideoX 1.0 rotary positions), latents 8 x 16 x 32 x 32 (F, C, H, W; patch 2: 2,048 video
tokens; --frames sets the 8), 64 text tokens, the pipeline's rotary tables, same random weights
(diffusers saves them, ours loads them with from_pretrained), same inputs, same thread count,
same update (global-norm clipping at 1.0, then AdamW). Each side takes a warm-up step, then
``--runs`` steps alternate between the two; the table prints each side's median, the floor (the
step's FLOPs over MindSpore's matmul rate measured in the same run), the ratios ours / floor and
ours / torch and, for ours, where the time goes (forward, backward, optimizer).
"""

from __future__ import annotations

import sys

import numpy as np
from _timing import our_train_step, torch_video_step, video_benchmark_main

GOALS = {"floor": 1.3, "torch": 1.4}  # Wan's (issue 27 sets goals for Wan and Qwen2.5-VL)
CONFIG = dict(num_attention_heads=8, attention_head_dim=64, in_channels=16, out_channels=16, time_embed_dim=512,
              text_embed_dim=4096, num_layers=4, sample_width=32, sample_height=32, patch_size=2,
              use_rotary_positional_embeddings=True)


def inputs(frames: int = 8):
    from mm_models_video import CogVideoXTransformerConfig
    from mm_models_video.cogvideox import rotary_tables

    rng = np.random.default_rng(0)
    return {"hidden_states": rng.standard_normal((1, frames, 16, 32, 32)).astype(np.float32),
            "timestep": np.array([600], np.int64),
            "encoder_hidden_states": rng.standard_normal((1, 64, 4096)).astype(np.float32),
            "image_rotary_emb": rotary_tables(CogVideoXTransformerConfig(**CONFIG), frames, 32, 32),
            "target": rng.standard_normal((1, frames, 16, 32, 32)).astype(np.float32)}


def torch_side(path, threads):
    import torch
    from diffusers import CogVideoXTransformer3DModel

    def to_kwargs(batch):
        kwargs = {k: torch.from_numpy(v) for k, v in batch.items() if k not in ("target", "image_rotary_emb")}
        return {**kwargs, "image_rotary_emb": tuple(torch.from_numpy(t) for t in batch["image_rotary_emb"])}

    return torch_video_step(lambda: CogVideoXTransformer3DModel(**CONFIG), path, threads, to_kwargs)


def our_side(path, precision: str = "fp32"):
    from mm_models_video import CogVideoXTransformer3DModel

    return our_train_step(CogVideoXTransformer3DModel.from_pretrained(path), precision)


def floor(config, batch):
    """(forward FLOPs, the FFN's matmul shape: video + text tokens x dim x 4 dim)."""
    from mm_models_video import CogVideoXTransformerConfig
    from mm_models_video.cogvideox.flops import batch_flops

    cfg = CogVideoXTransformerConfig(**{k: v for k, v in config.items() if not k.startswith("_")})
    _, frames, _, height, width = batch["hidden_states"].shape
    rows = frames * height * width // cfg.patch_size ** 2 + batch["encoder_hidden_states"].shape[1]
    return batch_flops(cfg, batch), (rows, cfg.inner_dim, 4 * cfg.inner_dim)


def main():
    return video_benchmark_main(__doc__, inputs, torch_side, our_side, lambda args: (
        f"CogVideoX transformer v-prediction train step, {args.frames * 256} video + 64 text tokens, "
        f"dim 512, 4 blocks, {args.threads} threads"), floor, GOALS)


if __name__ == "__main__":
    sys.exit(main())
