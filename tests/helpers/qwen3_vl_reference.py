"""Tiny Qwen3-VL and Qwen3-VL-MoE configs, weights and inputs shared by the parity and parallel tests.

The reference is transformers' Qwen3VL(Moe)ForConditionalGeneration on torch CPU (eager
attention, float32), with weights drawn wider than transformers' init, saved with the
reference's own save_pretrained and loaded into ours with from_pretrained. The tiny configs
exercise what differs from Qwen2.5-VL: head_dim != hidden / heads, a learned position table
smaller than the grids (so it is interpolated), two DeepStack levels, a dense layer among MoE ones
and 2 * moe_intermediate != hidden (so the fused and transposed expert layouts differ in shape).
"""

from __future__ import annotations

import numpy as np
from helpers.qwen_vl_reference import merged, placeholder, with_types_and_labels
from helpers.qwen_vl_reference import sample as qwen2_5_sample

IMAGE, VIDEO, START, END = 250, 251, 252, 253
PATCH_DIM = 3 * 2 * 16 * 16
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1,
           mlp_only_layers=[1], router_aux_loss_coef=0.1, output_router_logits=True)


def tiny_config(moe: bool = False, tie: bool = False, **text):
    import transformers

    text_config = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, intermediate_size=96, vocab_size=256, rms_norm_eps=1e-6, pad_token_id=0,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [6, 5, 5]})
    if moe:
        text_config.update(MOE, bos_token_id=1, eos_token_id=2)
    text_config.update(text)
    cls = transformers.Qwen3VLMoeConfig if moe else transformers.Qwen3VLConfig
    config = cls(text_config=text_config,
                 vision_config=dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                                    patch_size=16, num_position_embeddings=16, deepstack_visual_indexes=[0, 2]),
                 image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
                 tie_word_embeddings=tie)
    if not moe:
        config.eos_token_id = 2
    for c in (config, config.text_config, config.vision_config):
        c._attn_implementation = "eager"
    return config


def write_reference(path, seed: int = 0, moe: bool = False, tie: bool = False, **text):
    """A random reference model saved to ``path``; returns it (torch, eval mode, float32)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cls = transformers.Qwen3VLMoeForConditionalGeneration if moe else transformers.Qwen3VLForConditionalGeneration
    model = cls(tiny_config(moe, tie, **text)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "norm" in name or name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.5 / max(p.shape[-1], 1) ** 0.5)
    model.save_pretrained(str(path))
    return model


def video_placeholders(grid, rng):
    """Qwen3-VL's video layout: each temporal patch its own ``<t> <start> pads <end>`` group."""
    t, h, w = grid
    ids = []
    for _ in range(t):
        ids += rng.integers(3, 240, 2).tolist() + placeholder(VIDEO, (h // 2) * (w // 2))
    return ids


def sample(kind: str, rng: np.random.Generator):
    """(inputs dict of numpy arrays) for one named case (qwen_vl_reference.sample, Qwen3-VL's video layout)."""
    return qwen2_5_sample(kind, rng, patch_dim=PATCH_DIM, video_ids=video_placeholders, second_per_grid=None)


def padded_pair(rng: np.random.Generator):
    """Two samples, an image and a video, right-padded to one length; attention_mask marks pads."""
    rows = [rng.integers(3, 240, 2).tolist() + placeholder(IMAGE, merged((1, 4, 4))) + rng.integers(3, 240, 6).tolist(),
            rng.integers(3, 240, 1).tolist() + video_placeholders((2, 4, 8), rng) + rng.integers(3, 240, 2).tolist()]
    length = max(map(len, rows))
    ids, mask = np.zeros((2, length), np.int64), np.zeros((2, length), np.int64)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
    inputs = {"input_ids": ids, "attention_mask": mask,
              "pixel_values": rng.standard_normal((16, PATCH_DIM)).astype(np.float32),
              "image_grid_thw": np.array([(1, 4, 4)], np.int64),
              "pixel_values_videos": rng.standard_normal((64, PATCH_DIM)).astype(np.float32),
              "video_grid_thw": np.array([(2, 4, 8)], np.int64)}
    return with_types_and_labels(inputs)
