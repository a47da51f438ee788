"""Attention through Ascend's flash_attention_score, each mask in the kernel's own form.

The kernel (MindSpore 2.7's ``ops.flash_attention_score``) discards pairs where attn_mask is 1
and has cheaper forms than a full mask for the cases multimodal training meets:

    causal, no padding        sparse_mode 3 (rightDownCausal: key j <= i + k_len - q_len) with the
                              (2048, 2048) compressed triangle, made once per process
    packed sequences          input_layout "TND": the batch's rows back to back, each segment a
                              sequence of its own (actual_seq_qlen / kvlen = cumulative ends);
                              causal ones as sparse_mode 3 + the compressed triangle
    key padding               a (B, 1, q_len, k_len) bool mask built on the device from the
                              (B, k_len) keep mask (the kernel takes no (B, 1, 1, S) broadcast),
                              or-ed with a cached causal triangle when causal
    segments that are not contiguous runs (never produced by mm's models): the full mask, built
                              on the host, as the reference path does

A query with no allowed key (a fully padded sample, left padding under causal) is undefined in
the kernel's documentation; as on the reference path it returns zeros (a device-side product).
"""

from __future__ import annotations

import functools
from typing import Callable, List, Optional

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from mm_parallel.ops.device import host_array, tiled_to

_COMPRESSED = 2048
_INT_MAX = 2147483647


@functools.lru_cache(maxsize=1)
def compressed_causal_mask() -> Tensor:
    """The (2048, 2048) upper triangle (1 = discard) sparse modes 2-4 take in place of S x S."""
    return Tensor(np.triu(np.ones((_COMPRESSED, _COMPRESSED), np.uint8), 1))


def causal_allowed(q_len: int, k_len: int) -> np.ndarray:
    """(q_len, k_len) bool: key j allowed for query i when j <= i + k_len - q_len (bottom-right
    aligned: the last query sees every key)."""
    return np.arange(k_len)[None, :] <= np.arange(q_len)[:, None] + (k_len - q_len)


@functools.lru_cache(maxsize=16)
def _causal_dropped(q_len: int, k_len: int) -> Tensor:
    """(1, 1, q_len, k_len) bool, True above the causal diagonal (made once per shape)."""
    return Tensor(~causal_allowed(q_len, k_len)[None, None])


def _kernel(q, k, v, scale, **kwargs):
    return ops.flash_attention_score(q, k, v, q.shape[-2], scalar_value=float(scale), **kwargs)


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


def _padding_dropped(key_padding_mask, batch, q_len, k_len, causal):
    """(batch, 1, q_len, k_len) bool of discarded pairs, built on the device from the keep mask."""
    if tuple(key_padding_mask.shape) != (batch, k_len):
        raise ValueError(f"key_padding_mask must be (batch, k_len) = {(batch, k_len)}, "
                         f"got {tuple(key_padding_mask.shape)}")
    keep = key_padding_mask if isinstance(key_padding_mask, Tensor) else Tensor(np.asarray(key_padding_mask))
    dropped = ops.broadcast_to(ops.logical_not(keep.astype(ms.bool_)).reshape(batch, 1, 1, k_len),
                               (batch, 1, q_len, k_len))
    return ops.logical_or(dropped, _causal_dropped(q_len, k_len)) if causal else dropped


def flash_attention(q, k, v, scale, causal, key_padding_mask, q_segments, k_segments,
                    full_allowed: Callable[[], np.ndarray]):
    """mm_parallel.ops.attention's result (q, k, v in BSND) from the fused kernel; see the module
    docstring. ``full_allowed`` builds the host mask for the one case without a kernel form."""
    batch, q_len, heads, head_dim = q.shape
    k_len = k.shape[1]
    if q_segments is not None and key_padding_mask is None:
        ends = packed_ends(q_segments, k_segments, batch, q_len, k_len)
        if ends is not None:
            flat = [t.reshape(batch * t.shape[1], t.shape[2], head_dim) for t in (q, k, v)]
            mode = dict(attn_mask=compressed_causal_mask(), sparse_mode=3, pre_tokens=_INT_MAX,
                        next_tokens=0) if causal else {}
            out = _kernel(*flat, scale, actual_seq_qlen=ends, actual_seq_kvlen=ends, input_layout="TND", **mode)
            return out.reshape(q.shape)
    if q_segments is not None:
        dropped = Tensor(~np.broadcast_to(full_allowed(), (batch, 1, q_len, k_len)))
    elif key_padding_mask is not None:
        dropped = _padding_dropped(key_padding_mask, batch, q_len, k_len, causal)
    elif causal:
        out = _kernel(q, k, v, scale, attn_mask=compressed_causal_mask(), sparse_mode=3, input_layout="BSND")
        if q_len > k_len:  # the first q_len - k_len queries see no key
            out = out * tiled_to(Tensor((np.arange(q_len) >= q_len - k_len).astype(np.float32)
                                        .reshape(1, q_len, 1, 1), out.dtype), out.shape)
        return out
    else:
        return _kernel(q, k, v, scale, input_layout="BSND")
    out = _kernel(q, k, v, scale, attn_mask=dropped, input_layout="BSND")
    some_key = ops.logical_not(dropped).any(-1).astype(out.dtype)  # (batch, 1, q_len)
    return out * tiled_to(some_key.reshape(batch, q_len, 1, 1), out.shape)
