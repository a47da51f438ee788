"""Analytic FLOPs of a forward pass, per sample, for MFU.

A matrix product of (m, k) by (k, n) costs 2 m k n; only matrix products are counted (norms,
activations, softmax and rotary are a few percent and differ between kernels). Attention is
counted dense — Q K^T and P V over the whole score matrix, as eager and flash kernels without
causal block skipping compute it. A training step costs three forwards (backward = 2 x forward)
and, under full recomputation, four.

    decoder_lm_flops   decoder-only language model: GQA attention, gated (SwiGLU) MLP, vocabulary head
    vit_flops          vision transformer over packed patches with window / full attention segments
    qwen2_5_vl_flops   both, from a transformers Qwen2.5-VL config, the token count and image grids
    wan_dit_flops      Wan2.1's 3-D DiT (diffusers config): patch embedding, self-attention over
                       the video tokens, cross-attention to text (and image, I2V), FFN, time and
                       text embedders, output projection
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import numpy as np

TRAIN_FACTOR = 3  # forward + backward (2 x forward)
TRAIN_FACTOR_FULL_RECOMPUTE = 4


def matmul(m: int, k: int, n: int) -> int:
    """FLOPs of an (m, k) @ (k, n) product."""
    return 2 * int(m) * int(k) * int(n)


def decoder_lm_flops(seq: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                     vocab: int, head_dim: Optional[int] = None, gated: bool = True, lm_head: bool = True) -> int:
    """Forward FLOPs of one sequence of ``seq`` tokens through a decoder-only language model."""
    d = head_dim or hidden // heads
    projections = matmul(seq, hidden, heads * d) + 2 * matmul(seq, hidden, kv_heads * d) + matmul(seq, heads * d, hidden)
    attention = 2 * heads * matmul(seq, d, seq)  # Q K^T and P V per head
    mlp = (3 if gated else 2) * matmul(seq, hidden, intermediate)
    head = matmul(seq, hidden, vocab) if lm_head else 0
    return layers * (projections + attention + mlp) + head


def vit_flops(patches: int, patch_dim: int, hidden: int, heads: int, intermediate: int,
              segment_lengths_per_block: Sequence[Iterable[int]], gated: bool = True, merge: int = 1,
              out_hidden: Optional[int] = None) -> int:
    """Forward FLOPs of a vision transformer over ``patches`` packed patches.

    segment_lengths_per_block[b]: the lengths of the attention segments of block b (windows, or
    frames for full-attention blocks); the merger, if ``merge`` > 1, concatenates merge^2 patches
    and applies a two-layer MLP to ``out_hidden``.
    """
    total = matmul(patches, patch_dim, hidden)  # patch embedding (a stride = kernel convolution)
    mlp = (3 if gated else 2) * matmul(patches, hidden, intermediate)
    for lengths in segment_lengths_per_block:
        attention = sum(2 * heads * matmul(n, hidden // heads, n) for n in lengths)
        total += matmul(patches, hidden, 3 * hidden) + matmul(patches, hidden, hidden) + attention + mlp
    if merge > 1:
        unit = merge * merge
        total += matmul(patches // unit, hidden * unit, hidden * unit) + matmul(patches // unit, hidden * unit, out_hidden)
    return total


def qwen2_5_vl_flops(config, seq: int, image_grid_thw=None, video_grid_thw=None, lm_head: bool = True) -> int:
    """Forward FLOPs of one Qwen2.5-VL sample: ``seq`` tokens, its images' and videos' grids."""
    from mm_profiling._qwen_windows import segment_lengths

    text, vision = config.text_config, config.vision_config
    total = decoder_lm_flops(seq, text.hidden_size, text.num_hidden_layers, text.num_attention_heads,
                             text.num_key_value_heads, text.intermediate_size, text.vocab_size, lm_head=lm_head)
    for grids in (image_grid_thw, video_grid_thw):
        if grids is None or len(grids) == 0:
            continue
        grids = np.asarray(grids, np.int64).reshape(-1, 3)
        patches = int(np.prod(grids, axis=1).sum())
        window, frame = segment_lengths(grids, vision.spatial_merge_size, vision.window_size, vision.patch_size)
        per_block = [frame if i in set(vision.fullatt_block_indexes) else window for i in range(vision.depth)]
        patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        total += vit_flops(patches, patch_dim, vision.hidden_size, vision.num_heads, vision.intermediate_size,
                           per_block, merge=vision.spatial_merge_size, out_hidden=vision.out_hidden_size)
    return total


def _get(config, key):
    return config[key] if isinstance(config, dict) else getattr(config, key)


def wan_dit_flops(config, frames: int, height: int, width: int, text_len: int, image_len: int = 0) -> int:
    """Forward FLOPs of one Wan2.1 DiT sample on a latent of (frames, height, width).

    ``config``: diffusers' WanTransformer3DModel config (mapping or object). I2V (``image_dim``
    set) attends to ``image_len`` image tokens through its added key / value projections.
    """
    pt, ph, pw = _get(config, "patch_size")
    heads, head_dim = _get(config, "num_attention_heads"), _get(config, "attention_head_dim")
    dim, ffn = heads * head_dim, _get(config, "ffn_dim")
    tokens = (frames // pt) * (height // ph) * (width // pw)
    patch = pt * ph * pw
    total = matmul(tokens, _get(config, "in_channels") * patch, dim)  # patch embedding
    freq = _get(config, "freq_dim")
    total += matmul(1, freq, dim) + matmul(1, dim, dim) + matmul(1, dim, 6 * dim)  # time embedder + projection
    total += matmul(text_len, _get(config, "text_dim"), dim) + matmul(text_len, dim, dim)  # text embedder
    image_dim = _get(config, "image_dim") if (isinstance(config, dict) and "image_dim" in config) or \
        hasattr(config, "image_dim") else None
    if image_dim and image_len:
        total += matmul(image_len, image_dim, image_dim) + matmul(image_len, image_dim, dim)  # image embedder
    per_block = (4 * matmul(tokens, dim, dim) + 2 * heads * matmul(tokens, head_dim, tokens)  # self-attention
                 + 2 * matmul(tokens, dim, dim) + 2 * matmul(text_len, dim, dim)  # cross: q, out; k, v on text
                 + 2 * heads * matmul(tokens, head_dim, text_len)
                 + 2 * matmul(tokens, dim, ffn))  # FFN
    if image_dim and image_len:  # I2V: added k / v on the image tokens, a second attention
        per_block += 2 * matmul(image_len, dim, dim) + 2 * heads * matmul(tokens, head_dim, image_len)
    total += _get(config, "num_layers") * per_block
    total += matmul(tokens, dim, _get(config, "out_channels") * patch)  # output projection
    return total
