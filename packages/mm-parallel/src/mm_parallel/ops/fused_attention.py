"""Attention through Ascend's flash_attention_score, in the forms its documentation allows.

MindSpore 2.7.2's page (every restriction: mm_parallel.testing.flash_attention_contract) admits
head sizes D that are multiples of 16 up to 512, at most 256 query heads and 2048 sequences per
call; the packed TND layout only causal (sparse_mode 2 / 3 with the (2048, 2048) triangle,
next_tokens 0, pre_tokens >= the longest query); and it defines no result for a query with no
retained key. mm's calls:

    causal                  BSND, sparse_mode 3 (rightDownCausal: key j <= i + k_len - q_len) with
                            the compressed triangle; with q_len > k_len only the last k_len queries
                            go to the kernel (the first ones see no key: zeros)
    packed, causal          TND, sparse_mode 3, next_tokens 0, pre_tokens INT_MAX (>= max_seqlen_q),
                            actual_seq_qlen / kvlen the cumulative segment ends, <= 1024 per call
    packed, not causal      the segments as a batch, padded to the longest, BSND with a key padding
                            mask (the vision towers' windows and frames, the audio tower's chunks)
    key padding             a (B, 1, q_len, k_len) bool mask built on the device from the (B, k_len)
                            keep mask, or-ed with a cached causal triangle when causal
    other segment ids       (never produced by mm's models) the full mask, built on the host

    D not a multiple of 16  q, k, v zero-padded to the next multiple (q.k and p.v unchanged: exact),
                            the scale kept 1/sqrt(real D), the output cut back
    more than 2048 rows     in chunks of 2048 sequences
    no allowed key          such a query is given every key in the mask the kernel sees (a defined
                            result), and its output set to zero after the kernel with a select:
                            zeros forward, and no gradient flows into the kernel for it
"""

from __future__ import annotations

import functools
from typing import Callable, List, Optional

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from mm_parallel.ops.device import as_type, host_array, zeros

_COMPRESSED = 2048
_INT_MAX = 2147483647
MAX_BATCH, MAX_PACKED, MAX_HEADS, MAX_HEAD_DIM = 2048, 1024, 256, 512


@functools.lru_cache(maxsize=1)
def compressed_causal_mask() -> Tensor:
    """The (2048, 2048) upper triangle (1 = discard) sparse modes 2-4 take in place of S x S."""
    return Tensor(np.triu(np.ones((_COMPRESSED, _COMPRESSED), np.uint8), 1))


def causal_allowed(q_len: int, k_len: int) -> np.ndarray:
    """(q_len, k_len) bool: key j allowed for query i when j <= i + k_len - q_len (bottom-right
    aligned: the last query sees every key)."""
    return np.arange(k_len)[None, :] <= np.arange(q_len)[:, None] + (k_len - q_len)


def padded_head_dim(head_dim: int) -> int:
    """The head size the kernel is called with: the next multiple of 16."""
    return -(-head_dim // 16) * 16


def has_kernel_form(heads: int, head_dim: int) -> bool:
    """Whether the page admits these heads at all (else the reference path computes them)."""
    return heads <= MAX_HEADS and padded_head_dim(head_dim) <= MAX_HEAD_DIM


@functools.lru_cache(maxsize=16)
def _causal_dropped(q_len: int, k_len: int) -> Tensor:
    """(1, 1, q_len, k_len) bool, True above the causal diagonal (made once per shape)."""
    return Tensor(~causal_allowed(q_len, k_len)[None, None])


@functools.lru_cache(maxsize=64)
def _zeros(shape: tuple, dtype) -> Tensor:
    """Zeros made once per shape (the head-size padding, the rows before the first causal key)."""
    return zeros(shape, dtype)


def widened(t, width: int):
    """``t`` with columns of zeros up to ``width`` in its last dim (a head size padded for the kernel)."""
    extra = width - t.shape[-1]
    return t if not extra else ops.concat([t, _zeros(tuple(t.shape[:-1]) + (extra,), t.dtype)], -1)


def padded_runs(starts: np.ndarray, lengths: np.ndarray, total: int):
    """(gather (S, L): row of each slot, ``total`` where it is padding; valid (S, L) bool;
    scatter: the flat slot of each of the ``total`` rows) for S runs of rows padded to the longest L."""
    offsets = np.arange(int(lengths.max()))
    valid = offsets[None, :] < lengths[:, None]
    gather = np.where(valid, starts[:, None] + offsets[None, :], total)
    return gather, valid, np.flatnonzero(valid.reshape(-1))


def packed_ends(q_segments, k_segments, batch: int, q_len: int, k_len: int) -> Optional[List[int]]:
    """Cumulative ends of the sequences of the (batch, len) segment ids, rows back to back, when
    each segment is one contiguous run and keys and queries share them; else None."""
    qs = host_array(q_segments).reshape(-1, q_len)
    if q_len != k_len or (k_segments is not q_segments and not np.array_equal(qs, host_array(k_segments)
                                                                              .reshape(-1, k_len))):
        return None
    qs = np.broadcast_to(qs, (batch, q_len))
    ends, offset = [], 0
    for row in qs:
        starts = np.flatnonzero(np.diff(row)) + 1
        if len(np.unique(row)) != len(starts) + 1:
            return None  # an id comes back after another: not one run per segment
        ends += [offset + int(e) for e in list(starts) + [q_len]]
        offset += q_len
    return ends


# -- the kernel calls -------------------------------------------------------------------------------

def _kernel(q, k, v, dtype, **kwargs):
    """flash_attention_score with its operands in ``dtype`` and its output back in q's. On Ascend
    they are the same dtype; where bf16 is emulated the gathers, slices and padding around the
    call stay in float32 storage, which has their CPU kernels."""
    out = ops.flash_attention_score(*(as_type(t, dtype) for t in (q, k, v)), q.shape[-2], **kwargs)
    return as_type(out, q.dtype)


def _bsnd(q, k, v, scale, dtype, attn_mask=None, sparse_mode=0):
    """flash_attention_score in BSND, at most 2048 sequences per call (the page's B range)."""
    if q.shape[0] <= MAX_BATCH:
        return _kernel(q, k, v, dtype, attn_mask=attn_mask, scalar_value=float(scale), input_layout="BSND",
                       sparse_mode=sparse_mode)
    outs = []
    for b in range(0, q.shape[0], MAX_BATCH):
        part = slice(b, b + MAX_BATCH)
        mask = attn_mask if attn_mask is None or attn_mask.ndim == 2 or attn_mask.shape[0] == 1 else attn_mask[part]
        outs.append(_bsnd(q[part], k[part], v[part], scale, dtype, mask, sparse_mode))
    return ops.concat(outs, 0)


def _packed_causal(q, k, v, scale, dtype, ends: List[int]):
    """TND causal (sparse_mode 3) over rows (T, N, D) ending at ``ends``, <= 1024 sequences a call."""
    outs, row, first = [], 0, 0
    while first < len(ends):
        group = ends[first:first + MAX_PACKED]
        local = [e - row for e in group]
        part = slice(row, group[-1])
        outs.append(_kernel(q[part], k[part], v[part], dtype, attn_mask=compressed_causal_mask(),
                            actual_seq_qlen=local, actual_seq_kvlen=local, scalar_value=float(scale),
                            pre_tokens=_INT_MAX, next_tokens=0, input_layout="TND", sparse_mode=3))
        row, first = group[-1], first + MAX_PACKED
    return outs[0] if len(outs) == 1 else ops.concat(outs, 0)


@functools.lru_cache(maxsize=8)
def _segment_batch(ends: tuple, total: int):
    """(gather index, discarded-key mask or None, scatter index, (S, L)) of packed segments ending
    at ``ends`` of ``total`` rows, made once per layout: every layer of a tower shares it. The
    padding slots repeat row 0: as keys the mask drops them, as queries their output is never
    gathered back, so they add nothing forward or backward (and need no row of zeros)."""
    bounds = np.asarray((0,) + ends)
    gather, valid, scatter = padded_runs(bounds[:-1], np.diff(bounds), total)
    count, longest = gather.shape
    dropped = None if valid.all() else Tensor(np.broadcast_to(~valid[:, None, None, :],
                                                                (count, 1, longest, longest)).copy())
    index = Tensor(np.where(valid, gather, 0).reshape(-1).astype(np.int32))
    return index, dropped, Tensor(scatter.astype(np.int32)), (count, longest)


def _segments_as_batch(q, k, v, scale, dtype, ends: List[int]):
    """Non-causal packed segments (rows ending at ``ends`` of the flattened batch) as a padded
    batch in BSND, each slot seeing its own segment's keys (no mask when the segments are equal)."""
    total = q.shape[0] * q.shape[1]
    index, dropped, scatter, blocks = _segment_batch(tuple(ends), total)

    def to_blocks(x):
        return ops.gather(x.reshape((total,) + tuple(x.shape[2:])), index, 0).reshape(blocks + tuple(x.shape[2:]))

    out = _bsnd(to_blocks(q), to_blocks(k), to_blocks(v), scale, dtype, dropped)
    out = ops.gather(out.reshape((blocks[0] * blocks[1],) + tuple(out.shape[2:])), scatter, 0)
    return out.reshape(q.shape)


def _with_zero_rows(out, some_key):
    """out (B, S1, N, D) with the queries where ``some_key`` (B, 1, S1) is False set to zero by a
    select: the zeros are exact and the kernel's output for them gets no gradient."""
    keep = ops.broadcast_to(some_key.reshape(out.shape[0], out.shape[1], 1, 1), out.shape)
    return ops.select(keep, out, ops.zeros_like(out))


def _masked(q, k, v, scale, dtype, dropped):
    """The kernel under a (B, 1, S1, S2) bool mask of discarded pairs, queries with no key zeroed."""
    some_key = ops.logical_not(dropped).any(-1)  # (B, 1, S1)
    defined = ops.logical_and(dropped, some_key.reshape(some_key.shape + (1,)))  # empty rows: every key
    return _bsnd(q, k, v, scale, dtype, defined), some_key


def _padding_dropped(key_padding_mask, batch, q_len, k_len, causal):
    """(batch, 1, q_len, k_len) bool of discarded pairs, built on the device from the keep mask."""
    if tuple(key_padding_mask.shape) != (batch, k_len):
        raise ValueError(f"key_padding_mask must be (batch, k_len) = {(batch, k_len)}, "
                         f"got {tuple(key_padding_mask.shape)}")
    keep = key_padding_mask if isinstance(key_padding_mask, Tensor) else Tensor(np.asarray(key_padding_mask))
    dropped = ops.broadcast_to(ops.logical_not(keep.astype(ms.bool_)).reshape(batch, 1, 1, k_len),
                               (batch, 1, q_len, k_len))
    return ops.logical_or(dropped, _causal_dropped(q_len, k_len)) if causal else dropped


def _causal(q, k, v, scale, dtype):
    q_len, k_len = q.shape[1], k.shape[1]
    if q_len <= k_len:
        return _bsnd(q, k, v, scale, dtype, compressed_causal_mask(), sparse_mode=3)
    seen = _bsnd(q[:, q_len - k_len:], k, v, scale, dtype, compressed_causal_mask(), sparse_mode=3)
    return ops.concat([_zeros((q.shape[0], q_len - k_len) + tuple(seen.shape[2:]), seen.dtype), seen], 1)


def _dispatch(q, k, v, scale, dtype, causal, key_padding_mask, q_segments, k_segments, full_allowed):
    """(out, some_key or None): the kernel call of the case (module docstring)."""
    batch, q_len, heads, head_dim = q.shape
    k_len = k.shape[1]
    if q_segments is not None and key_padding_mask is None:
        ends = packed_ends(q_segments, k_segments, batch, q_len, k_len)
        if ends is not None and causal:
            flat = [t.reshape(batch * t.shape[1], t.shape[2], head_dim) for t in (q, k, v)]
            return _packed_causal(*flat, scale, dtype, ends).reshape(q.shape), None
        if ends is not None:
            return _segments_as_batch(q, k, v, scale, dtype, ends), None
        return _masked(q, k, v, scale, dtype, Tensor(~np.broadcast_to(full_allowed(), (batch, 1, q_len, k_len))))
    if key_padding_mask is not None:
        return _masked(q, k, v, scale, dtype, _padding_dropped(key_padding_mask, batch, q_len, k_len, causal))
    if causal:
        return _causal(q, k, v, scale, dtype), None
    return _bsnd(q, k, v, scale, dtype), None


def flash_attention(q, k, v, scale, causal, key_padding_mask, q_segments, k_segments,
                    full_allowed: Callable[[], np.ndarray], kernel_dtype):
    """mm_parallel.ops.attention's result (q, k, v in BSND) from the fused kernel, its operands in
    ``kernel_dtype`` (bf16 / fp16; fp32 only on the stand-ins' widening); see the module docstring.
    ``full_allowed`` builds the host mask for the one case without a kernel form."""
    head_dim = q.shape[-1]
    q, k, v = (widened(t, padded_head_dim(head_dim)) for t in (q, k, v))
    out, some_key = _dispatch(q, k, v, scale, kernel_dtype, causal, key_padding_mask, q_segments, k_segments,
                              full_allowed)
    out = out[..., :head_dim] if out.shape[-1] != head_dim else out
    return out if some_key is None else _with_zero_rows(out, some_key)
