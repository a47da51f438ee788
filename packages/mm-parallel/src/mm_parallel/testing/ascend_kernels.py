"""Stand-ins for Ascend's fused kernels: the documented semantics of each call, on CPU.

Each function has the signature of the MindSpore 2.7 call it replaces and does what that call's
API page says (cited per function; the docstrings of the installed mindspore 2.7.2 are the same
text), computed independently of mm_parallel's reference kernels in plain CPU MindSpore ops, so
autodiff gives the backward. Arguments the page forbids are refused with the error type the
page names. Where the page leaves a behaviour open, the docstring says what the stand-in does
and why callers must not rely on it.

One deliberate widening: the Ascend pages admit only float16 / bfloat16 for
flash_attention_score (grouped_matmul: float16 / float32), and the CPU has no bf16 / fp16
arithmetic kernels (DESIGN §4). ``allow_float32(True)`` lets the stand-ins take float32 too, so
whole models run through the fused branches in float32 and are compared with the reference path
at fp32 precision; without it float32 is refused as on Ascend (and the mm kernels route float32
to the reference path, as they must there).
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

INT_MAX = 2147483647
_LAYOUTS = ("BSH", "BNSD", "SBH", "BSND", "TND")
_COMPRESSED = 2048  # the (2048, 2048) optimised causal mask sparse modes 2, 3 and 4 take
_FILL = -1e30
_FLOAT32 = {"allowed": False}


def allow_float32(allowed: bool) -> None:
    """Whether the kernels documented for half precision only also take float32 (module docstring)."""
    _FLOAT32["allowed"] = bool(allowed)


def _check_dtype(what, x, allowed):
    if _FLOAT32["allowed"]:
        allowed = allowed + (ms.float32,)
    if not isinstance(x, Tensor):
        raise TypeError(f"{what} must be a Tensor, got {type(x).__name__}")
    if x.dtype not in allowed:
        raise TypeError(f"{what} has dtype {x.dtype}; the kernel takes {', '.join(str(d) for d in allowed)}")


def _ints(values):
    """A Tensor / tuple / list of ints as a Python list (reads a Tensor on the host: stand-in only)."""
    if isinstance(values, Tensor):
        values = values.asnumpy()
    return [int(v) for v in np.asarray(values).reshape(-1)]


# -- flash_attention_score ------------------------------------------------------------------------

def _to_bnsd(x, layout, heads_hint, head_dim=None):
    """(B, N, S, D) view of a BSH / SBH / BSND / BNSD tensor; for the H layouts ``heads_hint``
    (query) or ``head_dim`` (key / value) gives the split of H."""
    if layout in ("BSH", "SBH"):
        d = head_dim if head_dim is not None else x.shape[-1] // heads_hint
        if x.shape[-1] % d:
            raise RuntimeError(f"hidden size {x.shape[-1]} does not split into heads of {d}")
        x = x.reshape(x.shape[0], x.shape[1], x.shape[2] // d, d)
        return x.transpose(0, 2, 1, 3) if layout == "BSH" else x.transpose(1, 2, 0, 3)
    return x.transpose(0, 2, 1, 3) if layout == "BSND" else x


def _from_bnsd(x, layout):
    b, n, s, d = x.shape
    if layout == "BSH":
        return x.transpose(0, 2, 1, 3).reshape(b, s, n * d)
    if layout == "SBH":
        return x.transpose(2, 0, 1, 3).reshape(s, b, n * d)
    return x.transpose(0, 2, 1, 3) if layout == "BSND" else x


def _allowed_band(s1, s2, sparse_mode, pre_tokens, next_tokens):
    """(S1, S2) bool of the pairs the sparse mode computes (before attn_mask), i query, j key:
        0, 1  every pair (0 with a mask: also -pre_tokens <= j - i <= next_tokens, left-top)
        2     leftUpCausal    j <= i
        3     rightDownCausal j <= i + S2 - S1
        4     band, right-down aligned: -pre_tokens <= j - i - (S2 - S1) <= next_tokens
    (The pages call mode 4 "the part between next_tokens and pre_tokens"; its alignment follows
    Ascend's FlashAttentionScore documentation of the band mode: from the lower-right vertex.)"""
    diff = np.arange(s2)[None, :] - np.arange(s1)[:, None]
    if sparse_mode in (0, 1):
        return (diff >= -pre_tokens) & (diff <= next_tokens) if sparse_mode == 0 else np.ones((s1, s2), bool)
    if sparse_mode == 2:
        return diff <= 0
    shifted = diff - (s2 - s1)
    if sparse_mode == 3:
        return shifted <= 0
    return (shifted >= -pre_tokens) & (shifted <= next_tokens)


def _check_compressed_mask(attn_mask, sparse_mode):
    if attn_mask is None or tuple(attn_mask.shape) != (_COMPRESSED, _COMPRESSED):
        raise RuntimeError(f"sparse_mode {sparse_mode} needs the optimised attn_mask of shape (2048, 2048), got "
                           f"{None if attn_mask is None else tuple(attn_mask.shape)}")
    if not np.array_equal(attn_mask.asnumpy().astype(bool), np.triu(np.ones((_COMPRESSED,) * 2, bool), 1)):
        raise RuntimeError("the optimised attn_mask must be the (2048, 2048) upper triangle above the diagonal "
                           "(1 = discard), as the documentation's compression scenario builds it")


def _dropped_pairs(attn_mask, batch, heads, s1, s2, sparse_mode, pre_tokens, next_tokens):
    """(B or 1, N or 1, S1, S2) bool Tensor of discarded pairs, or None when none is."""
    if sparse_mode not in (0, 1, 2, 3, 4):
        raise RuntimeError(f"sparse_mode {sparse_mode} is not supported by this stand-in (0, 1, 2, 3, 4)")
    if sparse_mode in (2, 3, 4):
        _check_compressed_mask(attn_mask, sparse_mode)
        band = _allowed_band(s1, s2, sparse_mode, pre_tokens, next_tokens)
        return None if band.all() else Tensor(~band[None, None])
    if attn_mask is None:  # mode 0 without a mask: nothing is masked, pre / next tokens ignored
        if sparse_mode == 1:
            raise RuntimeError("sparse_mode 1 (allMask) needs attn_mask")
        return None
    _check_dtype("attn_mask", attn_mask, (ms.bool_, ms.uint8))
    shape = tuple(attn_mask.shape)
    if shape not in ((batch, heads, s1, s2), (batch, 1, s1, s2), (s1, s2)):
        raise RuntimeError(f"attn_mask shape {shape} is not (B, N1, S1, S2), (B, 1, S1, S2) or (S1, S2) = "
                           f"{(batch, heads, s1, s2)}")
    dropped = attn_mask.astype(ms.bool_)
    if len(shape) == 2:
        dropped = dropped.reshape((1, 1) + shape)
    if sparse_mode == 0:
        band = _allowed_band(s1, s2, 0, pre_tokens, next_tokens)
        if not band.all():
            dropped = ops.logical_or(dropped, Tensor(~band[None, None]))
    return dropped


def _attend(q, k, v, dropped, scale, real_shift, keep, keep_prob):
    """softmax(scale q k^T + pse, discarded pairs filled) v in float32, (B, N1, S1, D); k / v heads
    repeated for grouped-query attention. A row with every pair discarded is not defined by the
    page: the fill makes it the mean of the values (callers must not rely on it)."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.astype(ms.float32) for t in (q, k, v))
    if group > 1:
        k, v = ops.repeat_interleave(k, group, 1), ops.repeat_interleave(v, group, 1)
    scores = ops.matmul(q, k.transpose(0, 1, 3, 2)) * scale
    if real_shift is not None:
        scores = scores + real_shift.astype(ms.float32)
    if dropped is not None:
        scores = ops.masked_fill(scores, ops.broadcast_to(dropped, scores.shape), _FILL)
    probs = ops.softmax(scores, -1)
    if keep is not None:
        probs = probs * keep / keep_prob
    return ops.matmul(probs, v)


def _dropout_keep(drop_mask, keep_prob, shape):
    """Kept pairs from drop_mask's bits (B, N1, S1, S2 // 8), bit k of byte m = pair 8 m + k (little
    endian); None without dropout. The kernel's own random mask cannot be reproduced here."""
    if keep_prob == 1.0:
        if drop_mask is not None:
            raise ValueError("keep_prob 1.0 takes no drop_mask")
        return None
    if not 0.0 < keep_prob <= 1.0:
        raise ValueError(f"keep_prob must be in (0, 1], got {keep_prob}")
    if drop_mask is None:
        raise NotImplementedError("keep_prob < 1 without drop_mask draws the device's random mask; pass drop_mask")
    _check_dtype("drop_mask", drop_mask, (ms.uint8,))
    bits = np.unpackbits(drop_mask.asnumpy(), axis=-1, bitorder="little")
    if bits.shape != tuple(shape):
        raise RuntimeError(f"drop_mask unpacks to {bits.shape}, the scores are {tuple(shape)}")
    return Tensor(bits.astype(np.float32))


def flash_attention_score(query, key, value, head_num, real_shift=None, drop_mask=None, padding_mask=None,
                          attn_mask=None, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, keep_prob=1.0,
                          scalar_value=1.0, pre_tokens=INT_MAX, next_tokens=INT_MAX, inner_precise=0,
                          input_layout="BSH", sparse_mode=0):
    """mindspore.ops.flash_attention_score
    (https://www.mindspore.cn/docs/en/r2.7.2/api_python/ops/mindspore.ops.flash_attention_score.html):

        attention_out = Dropout(Softmax(Mask(scale * query key^T + pse, atten_mask)), keep_prob) value

    attn_mask 1 / True discards a pair; layouts BSH, SBH, BSND, BNSD and TND (packed: cumulative
    actual_seq_qlen / actual_seq_kvlen, each sequence alone); sparse modes as `_allowed_band`.
    Returns attention_out, shape and dtype of query."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_dtype(name, t, (ms.float16, ms.bfloat16))
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError("query, key and value must have the same dtype")
    if not isinstance(input_layout, str):
        raise TypeError("input_layout must be a string")
    if input_layout not in _LAYOUTS:
        raise ValueError(f"input_layout {input_layout!r} is not one of {_LAYOUTS}")
    if not isinstance(sparse_mode, int):
        raise TypeError("sparse_mode must be an int")
    if padding_mask is not None or prefix is not None:
        raise NotImplementedError("padding_mask is reserved and prefix belongs to sparse_mode 5")
    if head_num <= 0:
        raise RuntimeError("head_num must be greater than 0")
    if tuple(value.shape) != tuple(key.shape):
        raise RuntimeError("value must have key's shape")
    if input_layout == "TND":
        return _packed(query, key, value, head_num, actual_seq_qlen, actual_seq_kvlen, attn_mask, scalar_value,
                       pre_tokens, next_tokens, sparse_mode, real_shift, drop_mask, keep_prob)
    if actual_seq_qlen is not None or actual_seq_kvlen is not None:
        raise RuntimeError("actual_seq_qlen / actual_seq_kvlen belong to input_layout 'TND' only")
    q = _to_bnsd(query, input_layout, head_num)
    k = _to_bnsd(key, input_layout, None, q.shape[-1])
    v = _to_bnsd(value, input_layout, None, q.shape[-1])
    if q.shape[1] != head_num or head_num % k.shape[1]:
        raise RuntimeError(f"head_num {head_num} must be query's head count and divisible by key's {k.shape[1]}")
    if k.shape[-1] != q.shape[-1]:
        raise RuntimeError("D-axis of query, key and value is not the same")
    b, n, s1, _ = q.shape
    s2 = k.shape[2]
    dropped = _dropped_pairs(attn_mask, b, n, s1, s2, sparse_mode, pre_tokens, next_tokens)
    keep = _dropout_keep(drop_mask, keep_prob, (b, n, s1, s2))
    out = _attend(q, k, v, dropped, scalar_value, real_shift, keep, keep_prob)
    return _from_bnsd(out.astype(query.dtype), input_layout)


def _packed(query, key, value, head_num, qlen, kvlen, attn_mask, scale, pre_tokens, next_tokens, sparse_mode,
            real_shift, drop_mask, keep_prob):
    """TND: (T, N, D) tensors holding sequences back to back; sequence b is query rows
    [qlen[b-1], qlen[b]) against key rows [kvlen[b-1], kvlen[b]) (cumulative ends)."""
    if qlen is None or kvlen is None:
        raise RuntimeError("input_layout 'TND' needs actual_seq_qlen and actual_seq_kvlen")
    if real_shift is not None or drop_mask is not None or keep_prob != 1.0:
        raise NotImplementedError("this stand-in's TND path takes no pse and no dropout")
    q_ends, kv_ends = _ints(qlen), _ints(kvlen)
    if len(q_ends) != len(kv_ends) or len(q_ends) > 1024:
        raise RuntimeError("actual_seq_qlen and actual_seq_kvlen must have one entry per sequence (at most 1024)")
    if np.any(np.diff([0] + q_ends) < 0) or np.any(np.diff([0] + kv_ends) < 0):
        raise RuntimeError("actual_seq_qlen / actual_seq_kvlen are cumulative: non-decreasing")
    if q_ends[-1] != query.shape[0] or kv_ends[-1] != key.shape[0]:
        raise RuntimeError(f"the last actual_seq_qlen / kvlen ({q_ends[-1]}, {kv_ends[-1]}) must be T1, T2 "
                           f"({query.shape[0]}, {key.shape[0]})")
    if 0 in np.diff([0] + kv_ends):
        raise RuntimeError("0 should not exist in the key lengths")
    if attn_mask is not None and sparse_mode not in (2, 3):
        raise RuntimeError("with TND the attn_mask is the optimised lower triangle: sparse_mode 2 or 3")
    outs, q0, k0 = [], 0, 0
    for q1, k1 in zip(q_ends, kv_ends):
        if q1 > q0:
            q = query[q0:q1].transpose(1, 0, 2)[None]  # (1, N, s, D)
            k, v = (t[k0:k1].transpose(1, 0, 2)[None] for t in (key, value))
            if sparse_mode == 3 and q1 - q0 > k1 - k0:
                raise RuntimeError("with TND and sparse_mode 3 each query length must be at most its key length")
            dropped = _dropped_pairs(attn_mask, 1, head_num, q1 - q0, k1 - k0, sparse_mode, pre_tokens,
                                     next_tokens)
            outs.append(_attend(q, k, v, dropped, scale, None, None, 1.0)[0].transpose(1, 0, 2))
        q0, k0 = q1, k1
    return ops.concat(outs, 0).astype(query.dtype)


# -- rms_norm, rotary_position_embedding, swiglu --------------------------------------------------

def rms_norm(x, gamma, epsilon=1e-6):
    """mindspore.ops.rms_norm (https://www.mindspore.cn/docs/en/r2.7.2/api_python/ops/mindspore.ops.rms_norm.html):
    y = x / sqrt(mean(x^2) + eps) * gamma over gamma's trailing dims; returns (y in x's dtype,
    rstd float32 with those dims kept as 1)."""
    _check_dtype("x", x, (ms.float16, ms.float32, ms.bfloat16))
    _check_dtype("gamma", gamma, (ms.float16, ms.float32, ms.bfloat16))
    if x.dtype != gamma.dtype:
        raise TypeError(f"x ({x.dtype}) and gamma ({gamma.dtype}) must have the same dtype")
    if not isinstance(epsilon, float) or not 0.0 < epsilon <= 1.0:
        raise ValueError(f"epsilon must be a float in (0, 1], got {epsilon!r}")
    if gamma.ndim > x.ndim:
        raise ValueError("the rank of gamma must not exceed the rank of x")
    axes = tuple(range(x.ndim - gamma.ndim, x.ndim))
    h = x.astype(ms.float32)
    rstd = ops.rsqrt(ops.mean(h * h, axes, keep_dims=True) + epsilon)
    return (h * rstd * gamma.astype(ms.float32)).astype(x.dtype), rstd


def _rope_table_fits(x_shape, table_shape, mode):
    """Whether cos / sin of ``table_shape`` is a layout the page lists for x read as BNSD, BSND or
    SBND (x's dims d0, d1, d2, D)."""
    d0, d1, d2, d = x_shape
    half_split = [(1, 1, d2, d), (d0, 1, d2, d), x_shape,  # x BNSD
                  (1, d1, 1, d), (d0, d1, 1, d),           # x BSND
                  (d0, 1, 1, d), (d0, d1, 1, d)]           # x SBND
    interleaved = [(1, 1, d2, d), (1, d1, 1, d), (d0, 1, 1, d)]
    return tuple(table_shape) in (half_split if mode == 0 else interleaved)


def rotary_position_embedding(x, cos, sin, mode=0):
    """mindspore.ops.rotary_position_embedding
    (https://www.mindspore.cn/docs/en/r2.7.2/api_python/ops/mindspore.ops.rotary_position_embedding.html):
    out = x cos + rotate(x) sin over the last dim; mode 0 rotate_half (cat(-x2, x1)), mode 1
    rotate_interleaved (pairs (x[2i], x[2i+1]) -> (-x[2i+1], x[2i])). Tables in the layouts the
    page's table lists (mode 1: shared by the batch and the heads)."""
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a Tensor")
    if not isinstance(mode, int) or mode not in (0, 1):
        raise TypeError(f"mode must be the int 0 or 1, got {mode!r}")
    _check_dtype("x", x, (ms.float16, ms.bfloat16, ms.float32))
    if cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise TypeError("cos and sin must have x's dtype")
    if x.ndim != 4 or x.shape[-1] % 2 or x.shape[-1] >= 896:
        raise ValueError(f"x must be 4-D with an even last dim below 896, got {tuple(x.shape)}")
    if tuple(sin.shape) != tuple(cos.shape) or not _rope_table_fits(tuple(x.shape), tuple(cos.shape), mode):
        raise ValueError(f"cos / sin {tuple(cos.shape)} are not a documented layout for x {tuple(x.shape)} in "
                         f"mode {mode}")
    half = x.shape[-1] // 2
    if mode == 0:
        rotated = ops.concat([-x[..., half:], x[..., :half]], -1)
    else:
        pairs = x.reshape(x.shape[:-1] + (half, 2))
        rotated = ops.stack([-pairs[..., 1], pairs[..., 0]], -1).reshape(x.shape)
    return x * cos + rotated * sin


def swiglu(input, dim=-1):  # noqa: A002 - the documented argument name
    """mindspore.ops.swiglu (https://www.mindspore.cn/docs/en/r2.7.2/api_python/ops/mindspore.ops.swiglu.html):
    Swish(a) * b with a, b the first and second halves of ``input`` along ``dim``."""
    if not isinstance(input, Tensor):
        raise TypeError("input must be a Tensor")
    _check_dtype("input", input, (ms.float16, ms.float32, ms.bfloat16))
    if not isinstance(dim, int):
        raise TypeError("dim must be an int")
    if input.shape[dim] % 2:
        raise RuntimeError(f"dimension {dim} of {tuple(input.shape)} is not divisible by 2")
    a, b = ops.split(input, input.shape[dim] // 2, dim)
    return a * ops.sigmoid(a) * b


# -- grouped_matmul --------------------------------------------------------------------------------

def grouped_matmul(x, weight, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                   group_list=None, split_item=0, group_type=-1, transpose_a=False, transpose_b=False):
    """mindspore.ops.auto_generate.grouped_matmul (the GroupedMatmul page,
    https://www.mindspore.cn/docs/en/r2.7.2/api_python/ops/mindspore.ops.GroupedMatmul.html), the
    non-quantised forms:
        split_item 0, group_type -1: y_i = x_i weight_i (+ bias_i) for each pair of the lists
        split_item 3, group_type 0:  one x (M, K), one weight (E, K, N); rows [g_{e-1}, g_e) of x
                                     times weight[e], g = group_list (int64 cumulative, E entries)
    transpose_b reads weight[e] as (N, K). Float16 / float32 (x and weight alike). Returns a list."""
    if split_item not in (0, 3) or group_type not in (-1, 0):
        raise TypeError(f"split_item must be 0 or 3 and group_type -1 or 0, got {split_item}, {group_type}")
    if (split_item == 3) != (group_type == 0):
        raise TypeError("split_item 3 goes with group_type 0, split_item 0 with group_type -1")
    if any(t is not None for t in (scale, offset, antiquant_scale, antiquant_offset)) or transpose_a:
        raise NotImplementedError("this stand-in covers the non-quantised forms without transpose_a")
    xs, ws = list(x), list(weight)
    for t in xs + ws:
        _check_dtype("x / weight", t, (ms.float16, ms.float32))
    if split_item == 0:
        if group_list is not None or len(xs) != len(ws):
            raise TypeError("split_item 0 takes lists of equal length and no group_list")
        biases = list(bias) if bias is not None else [None] * len(xs)
        outs = [ops.matmul(a, w.T if transpose_b else w) for a, w in zip(xs, ws)]
        return [o if c is None else o + c for o, c in zip(outs, biases)]
    if group_list is None:
        raise TypeError("split_item 3 needs group_list")
    if bias is not None:
        raise NotImplementedError("the differentiable form (split_item 3, group_type 0) takes no bias")
    if len(xs) != 1 or len(ws) != 1 or xs[0].ndim != 2 or ws[0].ndim != 3:
        raise ValueError("split_item 3 takes one 2-D x and one 3-D weight")
    if not isinstance(group_list, Tensor) or group_list.dtype != ms.int64:
        raise TypeError("group_list must be an int64 Tensor")
    ends = _ints(group_list)
    a, w = xs[0], ws[0]
    if len(ends) != w.shape[0] or ends[-1] != a.shape[0] or np.any(np.diff([0] + ends) < 0):
        raise ValueError(f"group_list {ends} must hold {w.shape[0]} cumulative row counts ending at {a.shape[0]}")
    parts, start = [], 0
    for e, end in enumerate(ends):
        if end > start:
            parts.append(ops.matmul(a[start:end], w[e].T if transpose_b else w[e]))
        start = end
    return [ops.concat(parts, 0) if len(parts) > 1 else parts[0]]
