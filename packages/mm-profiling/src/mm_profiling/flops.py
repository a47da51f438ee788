"""Analytic FLOPs of a forward pass, per sample, for MFU.

A matrix product of (m, k) by (k, n) costs 2 m k n; only matrix products are counted (norms,
activations, softmax and rotary are a few percent and differ between kernels). Attention is
counted dense — Q K^T and P V over the whole score matrix, as eager and flash kernels without
causal block skipping compute it. A training step costs three forwards (backward = 2 x forward)
and, under full recomputation, four.

    matmul             one matrix product
    decoder_lm_flops   decoder-only language model: GQA attention, gated (SwiGLU) MLP, vocabulary head
    vit_flops          vision transformer over packed patches with window / full attention segments

These are the formula helpers; each model's own count lives next to the model (as torchtitan's
get_nparams_and_flops does): ``model.flops(batch)`` in mm-models-vl / mm-models-video.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

TRAIN_FACTOR = 3  # forward + backward (2 x forward)
TRAIN_FACTOR_FULL_RECOMPUTE = 4


def matmul(m: int, k: int, n: int) -> int:
    """FLOPs of an (m, k) @ (k, n) product."""
    return 2 * int(m) * int(k) * int(n)


def decoder_lm_flops(seq: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                     vocab: int, head_dim: Optional[int] = None, gated: bool = True, lm_head: bool = True) -> int:
    """Forward FLOPs of one sequence of ``seq`` tokens through a decoder-only language model."""
    d = head_dim or hidden // heads
    projections = (matmul(seq, hidden, heads * d) + 2 * matmul(seq, hidden, kv_heads * d)
                   + matmul(seq, heads * d, hidden))
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
        merged = patches // unit
        total += matmul(merged, hidden * unit, hidden * unit) + matmul(merged, hidden * unit, out_hidden)
    return total
