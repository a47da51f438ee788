"""One Qwen2.5-VL train step (forward, backward, AdamW), ours vs transformers on torch CPU.

    python benchmarks/step_time_qwen2_5_vl.py [--runs 5] [--threads 2] [--vocab 32000]

Same config for both (language hidden 512, 4 layers, 8 heads / 2 kv heads, vision depth 4, one
224 x 224 image = 256 patches = 64 merged tokens, 512 tokens in all), same random weights (the
torch model saves them, ours loads them with from_pretrained), same inputs, same thread count,
same update (global-norm clipping at 1.0, then AdamW).
Each side takes a warm-up step, then ``--runs`` steps alternate between the two; the table prints
each side's median, the floor (the step's FLOPs over MindSpore's matmul rate measured in the same
run), the ratios ours / floor (goal <= 1.3) and ours / torch (goal <= 1.0) and, for ours, where
the time goes (forward, backward, optimizer).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import numpy as np
from _timing import compare_steps, our_train_step

IMAGE, VIDEO, START, END = 151655, 151656, 151652, 151653
GOALS = {"floor": 1.3, "torch": 1.0}


def floor(cfg, batch, flops):
    """(forward FLOPs by ``flops(cfg, batch)``, the language MLP's matmul shape: tokens x hidden x intermediate)."""
    text = cfg.text_config
    return flops(cfg, batch), (batch["input_ids"].shape[1], text.hidden_size, text.intermediate_size)


def config(vocab: int):
    from transformers import Qwen2_5_VLConfig

    cfg = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                         intermediate_size=1408, vocab_size=vocab, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [8, 12, 12]}),
        vision_config=dict(depth=4, hidden_size=256, num_heads=4, intermediate_size=512, out_hidden_size=512,
                           window_size=112, fullatt_block_indexes=[3], tokens_per_second=2),
        image_token_id=vocab - 4, video_token_id=vocab - 3, vision_start_token_id=vocab - 2,
        vision_end_token_id=vocab - 1)
    for c in (cfg, cfg.text_config, cfg.vision_config):
        c._attn_implementation = "eager"
    return cfg


def inputs(cfg, seq: int = 512, patch: int = 14):
    """One picture of 16 x 16 patches (224 pixels a side at patch 14, 256 at 16), 64 merged tokens,
    in ``seq`` tokens of random text."""
    rng = np.random.default_rng(0)
    grid = (1, 16, 16)
    merged = 64
    text = seq - merged - 2
    ids = rng.integers(3, cfg.image_token_id, text).tolist()
    ids = ids[:8] + [cfg.vision_start_token_id] + [cfg.image_token_id] * merged + [cfg.vision_end_token_id] + ids[8:]
    ids = np.array([ids], np.int64)
    types = (ids == cfg.image_token_id).astype(np.int64)
    labels = np.where(types == 1, -100, ids)
    return {"input_ids": ids, "mm_token_type_ids": types, "labels": labels,
            "pixel_values": rng.standard_normal((256, 3 * 2 * patch * patch)).astype(np.float32),
            "image_grid_thw": np.array([grid], np.int64)}


def torch_side(cfg, path, threads, class_name: str = "Qwen2_5_VLForConditionalGeneration"):
    """A train step of transformers' ``class_name`` (its weights saved to ``path``)."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(cfg).float().train()
    model.save_pretrained(path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step(batch):
        t0 = time.perf_counter()
        loss = model(**{k: torch.from_numpy(v) for k, v in batch.items()}).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # as ours (and transformers' Trainer) by default
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0, float(loss)

    return step


def our_side(path, class_name: str = "Qwen2_5_VLForConditionalGeneration", precision: str = "fp32"):
    """A train step of mm_models_vl's ``class_name`` loaded from ``path``, with its breakdown."""
    import mm_models_vl

    return our_train_step(getattr(mm_models_vl, class_name).from_pretrained(path), precision)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--no-bf16", action="store_true", help="skip the emulated bf16 step")
    args = parser.parse_args()
    import mm_parallel  # noqa: F401  (before any MindSpore op: blocking launch on CPU)
    from mm_models_vl.qwen2_5_vl.flops import batch_flops

    cfg = config(args.vocab)
    batch = inputs(cfg)
    with tempfile.TemporaryDirectory() as path:
        theirs = torch_side(cfg, path, args.threads)
        ours, parts = our_side(path)
        bf16 = None if args.no_bf16 else our_side(path, precision="bf16")[0]
        compare_steps(ours, theirs, batch, args.runs, parts,
                      f"Qwen2.5-VL train step, {batch['input_ids'].shape[1]} tokens (64 image), vocab {args.vocab}, "
                      f"{args.threads} threads", emulated_bf16=bf16, floor=floor(cfg, batch, batch_flops), goals=GOALS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
