"""Scaled dot-product attention with the masks multimodal training needs, and its log-sum-exp.

q: (batch, q_len, heads, head_dim); k, v: (batch, k_len, kv_heads, head_dim), heads a multiple of
kv_heads (grouped-query attention: kv head j serves query heads j*g .. j*g+g-1, as transformers'
repeat_kv). Returns (batch, q_len, heads, head_dim) and, with ``return_lse``, the float32
log-sum-exp of the scaled scores per (batch, heads, q_len) — what ring attention merges blocks by.

    out_i = sum_j softmax_j(s_ij) v_j,   s_ij = scale * q_i . k_j   over allowed (i, j)
    lse_i = log sum_j exp(s_ij)          over allowed (i, j)

Allowed pairs: every pair, minus
  causal            j > i + (k_len - q_len)   (bottom-right aligned: the last query sees every key)
  key_padding_mask  keys whose mask is 0 / False   (batch, k_len), transformers' attention_mask
  segment_ids       pairs from different segments  (packed sequences; (batch, len) ids, or
                    cu_seqlens (n+1,) boundaries of a batch-of-one packing, flash-attn's varlen form)
A query with no allowed key returns zeros and lse = -1e30 (finite, so merging stays NaN-free).
Scores and softmax are computed in float32.
"""

from __future__ import annotations

from typing import Optional

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mm_parallel.ops.device import as_type, tiled_to, use_fused

_MASKED = -1e30
_TINY = 1e-30
_matmul_nt = ops.BatchMatMul(transpose_b=True)
_matmul_nn = ops.BatchMatMul()


def segment_ids_from_cu_seqlens(cu_seqlens, total: int):
    """(1, total) segment ids from flash-attn's cumulative boundaries [0, l0, l0+l1, ..., total]."""
    bounds = np.asarray(cu_seqlens.asnumpy() if isinstance(cu_seqlens, Tensor) else cu_seqlens, dtype=np.int64)
    if bounds.ndim != 1 or bounds[0] != 0 or bounds[-1] != total or np.any(np.diff(bounds) < 0):
        raise ValueError(f"cu_seqlens must rise from 0 to the packed length {total}, got {bounds.tolist()}")
    ids = np.repeat(np.arange(len(bounds) - 1, dtype=np.int32), np.diff(bounds))
    return Tensor(ids[None, :])


def _allowed(batch, q_len, k_len, causal, key_padding_mask, q_segments, k_segments):
    """float32 (batch or 1, 1, q_len, k_len) of allowed pairs (1) and masked ones (0), or None when
    every pair is allowed. Built with float arithmetic, no boolean tensors: inside a recomputed
    Cell MindSpore 2.7.2 differentiates every intermediate and fails on boolean ones."""
    mask = None
    if causal:
        i = np.arange(q_len)[:, None] + (k_len - q_len)
        mask = Tensor((np.arange(k_len)[None, :] <= i)[None, None].astype(np.float32))
    if key_padding_mask is not None:
        if tuple(key_padding_mask.shape) != (batch, k_len):
            raise ValueError(f"key_padding_mask must be (batch, k_len) = {(batch, k_len)}, got {tuple(key_padding_mask.shape)}")
        keep = as_type(key_padding_mask, ms.float32)[:, None, None, :]
        mask = keep if mask is None else mask * keep
    if q_segments is not None:
        if q_segments.shape[-1] != q_len or k_segments.shape[-1] != k_len:
            raise ValueError(
                f"segment ids {tuple(q_segments.shape)} / {tuple(k_segments.shape)} do not match q_len {q_len} / k_len {k_len}"
            )
        qs = q_segments.astype(ms.float32)[:, None, :, None]
        ks = k_segments.astype(ms.float32)[:, None, None, :]
        same = ops.relu(1.0 - ops.abs(qs - ks))  # integer ids: 1 where equal, 0 elsewhere
        mask = same if mask is None else mask * same
    return mask


class _Softmax(nn.Cell):
    """softmax over the last dim with the backward dx = y (dy - sum_j dy_j y_j) written out: the
    row sum as a matmul with ones and the subtraction on tiled operands. MindSpore's own softmax
    backward broadcasts, which on CPU made it 2x slower (51 -> 27 ms on 8 x 512 x 512 scores)."""

    def construct(self, scores):
        return ops.softmax(scores, -1)

    def bprop(self, scores, out, dout):
        row = ops.matmul(dout * out, ops.ones((out.shape[-1], 1), ms.float32))
        return (out * (dout - tiled_to(row, out.shape)),)


_softmax = _Softmax()


def _repeat_kv(x, groups: int):
    """(b, kv_heads, s, d) -> (b, kv_heads * groups, s, d), each kv head repeated ``groups`` times in place."""
    return x if groups == 1 else ops.repeat_interleave(x, groups, 1)


def attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    key_padding_mask=None,
    segment_ids=None,
    kv_segment_ids=None,
    cu_seqlens=None,
    scale: Optional[float] = None,
    bias=None,
    return_lse: bool = False,
):
    """Attention of q over (k, v) in (batch, seq, heads, head_dim); see the module docstring.
    ``bias``: float scores added before the softmax, (batch or 1, heads, q_len, k_len) — T5's
    relative position bias."""
    batch, q_len, heads, head_dim = q.shape
    k_len, kv_heads = k.shape[1], k.shape[2]
    if heads % kv_heads or tuple(k.shape) != tuple(v.shape) or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(
            f"attention shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: k and v must match, share "
            "batch and head_dim with q, and have a number of heads dividing q's"
        )
    if cu_seqlens is not None:
        if segment_ids is not None or batch != 1 or q_len != k_len:
            raise ValueError("cu_seqlens describes one packed self-attention sequence: batch 1, no segment_ids")
        segment_ids = segment_ids_from_cu_seqlens(cu_seqlens, q_len)
    if segment_ids is not None and kv_segment_ids is None:
        if q_len != k_len:
            raise ValueError("segment_ids alone need q_len == k_len; pass kv_segment_ids for the keys")
        kv_segment_ids = segment_ids
    scale = head_dim ** -0.5 if scale is None else scale
    mask = _allowed(batch, q_len, k_len, causal, key_padding_mask, segment_ids, kv_segment_ids)

    if use_fused() and not return_lse and bias is None:
        return _fused(q, k, v, mask, scale)

    dtype = q.dtype
    # scale q (b*s*h*d values) rather than the scores (b*h*q*k)
    qh = (as_type(q, ms.float32) * scale).transpose(0, 2, 1, 3)
    kh = _repeat_kv(as_type(k, ms.float32).transpose(0, 2, 1, 3), heads // kv_heads)
    vh = _repeat_kv(as_type(v, ms.float32).transpose(0, 2, 1, 3), heads // kv_heads)
    scores = _matmul_nt(qh, kh)  # (b, h, q, k)
    if bias is not None:
        scores = scores + tiled_to(as_type(bias, ms.float32), scores.shape)
    if mask is not None:
        scores = scores + tiled_to((mask - 1.0) * -_MASKED, scores.shape)
    if not return_lse:
        out = _matmul_nn(_softmax(scores), vh)
    else:
        # The max only keeps exp in range; lse = m + log sum exp(s - m) has the right gradient
        # (softmax) with m held constant.
        row_max = ops.stop_gradient(scores.max(axis=-1, keepdims=True))
        weights = ops.exp(scores - tiled_to(row_max, scores.shape))
        total = ops.maximum(ops.matmul(weights, ops.ones((k_len, 1), ms.float32)), _TINY)  # row sums
        out = _matmul_nn(weights, vh) / total
    if mask is not None and _rows_may_be_empty(causal, q_len, k_len, key_padding_mask, segment_ids):
        out = out * mask.max(axis=-1, keepdims=True)  # zeros where no key is allowed
    out = as_type(out.transpose(0, 2, 1, 3), dtype)
    if not return_lse:
        return out
    return out, (row_max + ops.log(total)).squeeze(-1)


def _rows_may_be_empty(causal, q_len, k_len, key_padding_mask, segment_ids) -> bool:
    """Whether some query may have no allowed key (then its softmax row must become zeros)."""
    return key_padding_mask is not None or segment_ids is not None or (causal and q_len > k_len)


def _fused(q, k, v, mask, scale):
    """Ascend flash_attention_score (BSND layout); its attn_mask marks pairs to drop with 1."""
    drop = None
    if mask is not None:
        full = ops.broadcast_to(mask, (q.shape[0], 1, q.shape[1], k.shape[1]))
        drop = (1.0 - full).astype(ms.uint8)
    return ops.flash_attention_score(
        q, k, v, q.shape[2], attn_mask=drop, scalar_value=scale, input_layout="BSND"
    )
