"""Stand-ins for Ascend's flash attention on CPU: the function, the primitive and its backward.

- ``flash_attention_score``: mindspore.ops.flash_attention_score (MindSpore 2.7.2), which returns
  attention_out;
- ``FlashAttentionScore``: the primitive under it (mindspore.ops.operations.nn_ops), which also
  returns the softmax statistics (softmax_max, softmax_sum: (B, N1, S1, 8) float32, the row's
  statistic repeated 8 times) that ring attention merges blocks by. Its backward differentiates
  attention_out only: the statistics get no gradient (stop_gradient here);
- ``FlashAttentionScoreGrad``: the primitive MindSpore's backward calls, from the statistics and
  the forward's output: FlashAttention-2's backward (stated in `_grad`).

Each call is first held to the page's restrictions (flash_attention_contract.check_call), then
computed independently of mm_parallel's attention in plain float32 CPU MindSpore ops (autodiff
gives the function's backward): scores = scale q k^T (+ real_shift), the discarded pairs of
attn_mask and the sparse mode removed, softmax, (dropout), times value; out in query's dtype.

Undefined results are poisoned, so code that relies on them fails here: a query row with no
retained key has no softmax (the page defines none), so its output row is NaN and every input
gradient of that call is NaN (the kernel's backward sums the rows into dk and dv).
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mm_parallel.testing import flash_attention_contract as contract
from mm_parallel.testing.flash_attention_contract import INT_MAX

_FILL = -1e30
_FLOAT32 = {"allowed": False}


def allow_float32(allowed: bool) -> None:
    """Whether the half-precision-only kernels also take float32 (mm_parallel.testing.ascend_kernels)."""
    _FLOAT32["allowed"] = bool(allowed)


def _dtypes():
    return (ms.float16, ms.bfloat16) + ((ms.float32,) if _FLOAT32["allowed"] else ())


# -- the pairs a sparse mode keeps ------------------------------------------------------------------

def allowed_band(s1, s2, sparse_mode, pre_tokens, next_tokens) -> np.ndarray:
    """(S1, S2) bool of the pairs the sparse mode computes (before attn_mask), i query, j key:
        0, 1  every pair (0 with a mask: also -pre_tokens <= j - i <= next_tokens, left-top)
        2     leftUpCausal    j <= i
        3     rightDownCausal j <= i + S2 - S1
        4     band, right-down aligned: -pre_tokens <= j - i - (S2 - S1) <= next_tokens
    (The page calls mode 4 "the part between next_tokens and pre_tokens"; its alignment follows
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


def _dropped_pairs(attn_mask, s1, s2, sparse_mode, pre_tokens, next_tokens) -> np.ndarray:
    """(B or 1, N1 or 1, S1, S2) bool of discarded pairs (the host copy: the stand-in reads it)."""
    if sparse_mode in (2, 3, 4):
        return ~allowed_band(s1, s2, sparse_mode, pre_tokens, next_tokens)[None, None]
    if attn_mask is None:  # mode 0 without a mask: nothing discarded, pre / next tokens ignored
        return np.zeros((1, 1, s1, s2), bool)
    dropped = attn_mask.asnumpy().astype(bool)
    dropped = dropped.reshape((1, 1) + dropped.shape) if dropped.ndim == 2 else dropped
    if sparse_mode == 0:
        dropped = dropped | ~allowed_band(s1, s2, 0, pre_tokens, next_tokens)[None, None]
    return dropped


# -- layouts -----------------------------------------------------------------------------------------

def to_bnsd(x, layout, head_dim):
    """(B, N, S, D) view of a BSH / SBH / BSND / BNSD tensor."""
    if layout in ("BSH", "SBH"):
        x = x.reshape(x.shape[0], x.shape[1], x.shape[2] // head_dim, head_dim)
        return x.transpose(0, 2, 1, 3) if layout == "BSH" else x.transpose(1, 2, 0, 3)
    return x.transpose(0, 2, 1, 3) if layout == "BSND" else x


def from_bnsd(x, layout):
    b, n, s, d = x.shape
    if layout == "BSH":
        return x.transpose(0, 2, 1, 3).reshape(b, s, n * d)
    if layout == "SBH":
        return x.transpose(2, 0, 1, 3).reshape(s, b, n * d)
    return x.transpose(0, 2, 1, 3) if layout == "BSND" else x


# -- the computation ---------------------------------------------------------------------------------

class _Undefined(nn.Cell):
    """Identity whose gradient is NaN: the input feeds a call whose result the page leaves undefined."""

    def construct(self, x):
        return x

    def bprop(self, x, out, dout):
        return (dout * float("nan"),)


_undefined = _Undefined()


def _attend(q, k, v, dropped: np.ndarray, scale, real_shift=None, keep=None, keep_prob=1.0):
    """(out, row max, row sum) in float32: out (B, N1, S1, D) = softmax(scale q k^T + pse with the
    dropped pairs removed) v; k / v heads repeated for grouped-query attention. Rows with every pair
    dropped come back NaN and poison the gradients (module docstring)."""
    empty = dropped.all(-1)  # (B or 1, N or 1, S1)
    if empty.any():
        q, k, v = _undefined(q), _undefined(k), _undefined(v)
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.astype(ms.float32) for t in (q, k, v))
    if group > 1:
        k, v = ops.repeat_interleave(k, group, 1), ops.repeat_interleave(v, group, 1)
    scores = ops.matmul(q, k.transpose(0, 1, 3, 2)) * scale
    if real_shift is not None:
        scores = scores + real_shift.astype(ms.float32)
    if dropped.any():
        scores = ops.masked_fill(scores, ops.broadcast_to(Tensor(dropped), scores.shape), _FILL)
    row_max = ops.stop_gradient(ops.amax(scores, -1, True))
    weights = ops.exp(scores - row_max)
    row_sum = weights.sum(-1, keepdims=True)
    probs = weights / row_sum
    if keep is not None:
        probs = probs * keep / keep_prob
    out = ops.matmul(probs, v)
    if empty.any():
        undefined = np.broadcast_to(empty[..., None], tuple(out.shape))
        out = ops.select(Tensor(undefined), ops.fill(ms.float32, out.shape, float("nan")), out)
    return out, row_max, row_sum


def _dropout_keep(drop_mask, keep_prob, shape):
    """Kept pairs from drop_mask's bits (B, N1, S1, S2 // 8), bit k of byte m = pair 8 m + k (little
    endian); None without dropout. The kernel's own random mask cannot be reproduced here."""
    if keep_prob == 1.0:
        return None
    if drop_mask is None:
        raise NotImplementedError("keep_prob < 1 without drop_mask draws the device's random mask; pass drop_mask")
    bits = np.unpackbits(drop_mask.asnumpy(), axis=-1, bitorder="little")
    return Tensor(bits.reshape(shape).astype(np.float32))


def _packed(query, key, value, dims, scale, attn_mask, sparse_mode):
    """TND: sequence b is query rows [qlen[b-1], qlen[b]) against key rows [kvlen[b-1], kvlen[b])."""
    dtype = query.dtype
    query, key, value = (t.astype(ms.float32) for t in (query, key, value))  # the CPU slices float32 only
    outs, q0, k0 = [], 0, 0
    for q_len, k_len in zip(dims.q_lens, dims.k_lens):
        if q_len:
            q = query[q0:q0 + q_len].transpose(1, 0, 2)[None]
            k, v = (t[k0:k0 + k_len].transpose(1, 0, 2)[None] for t in (key, value))
            dropped = _dropped_pairs(attn_mask, q_len, k_len, sparse_mode, 0, 0)
            outs.append(_attend(q, k, v, dropped, scale)[0][0].transpose(1, 0, 2))
        q0, k0 = q0 + q_len, k0 + k_len
    return ops.concat(outs, 0).astype(dtype)


def _forward(query, key, value, head_num, real_shift, drop_mask, padding_mask, attn_mask, prefix, actual_seq_qlen,
             actual_seq_kvlen, keep_prob, scalar_value, pre_tokens, next_tokens, input_layout, sparse_mode):
    """(out in query's layout and dtype, row max, row sum (B, N1, S1, 1) float32 or None for TND)."""
    dims = contract.check_call(query, key, value, head_num, real_shift, drop_mask, padding_mask, attn_mask, prefix,
                               actual_seq_qlen, actual_seq_kvlen, keep_prob, scalar_value, pre_tokens, next_tokens,
                               input_layout, sparse_mode, _dtypes())
    if input_layout == "TND":
        return _packed(query, key, value, dims, scalar_value, attn_mask, sparse_mode), None, None
    q, k, v = (to_bnsd(t, input_layout, dims.head_dim) for t in (query, key, value))
    dropped = _dropped_pairs(attn_mask, dims.q_len, dims.k_len, sparse_mode, pre_tokens, next_tokens)
    keep = _dropout_keep(drop_mask, keep_prob, (dims.batch, dims.heads, dims.q_len, dims.k_len))
    out, row_max, row_sum = _attend(q, k, v, dropped, scalar_value, real_shift, keep, keep_prob)
    return from_bnsd(out.astype(query.dtype), input_layout), row_max, row_sum


def flash_attention_score(query, key, value, head_num, real_shift=None, drop_mask=None, padding_mask=None,
                          attn_mask=None, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, keep_prob=1.0,
                          scalar_value=1.0, pre_tokens=INT_MAX, next_tokens=INT_MAX, inner_precise=0,
                          input_layout="BSH", sparse_mode=0):
    """mindspore.ops.flash_attention_score: attention_out, shape and dtype of query (module docstring)."""
    return _forward(query, key, value, head_num, real_shift, drop_mask, padding_mask, attn_mask, prefix,
                    actual_seq_qlen, actual_seq_kvlen, keep_prob, scalar_value, pre_tokens, next_tokens,
                    input_layout, sparse_mode)[0]


class FlashAttentionScore:
    """The primitive: ``FlashAttentionScore(head_num, keep_prob, scale_value, pre_tokens,
    next_tokens, inner_precise, input_layout, sparse_mode)(query, key, value, real_shift,
    drop_mask, padding_mask, attn_mask, prefix, actual_seq_qlen, actual_seq_kvlen)`` returns
    (softmax_max, softmax_sum, softmax_out, attention_out); the statistics (B, N1, S1, 8) are the
    scores' row max and sum of exp(score - max), without gradient. Not modelled: TND statistics."""

    def __init__(self, head_num, keep_prob=1.0, scale_value=1.0, pre_tokens=INT_MAX, next_tokens=INT_MAX,
                 inner_precise=0, input_layout="BSH", sparse_mode=0):
        self.args = dict(head_num=head_num, keep_prob=keep_prob, scalar_value=scale_value, pre_tokens=pre_tokens,
                         next_tokens=next_tokens, input_layout=input_layout, sparse_mode=sparse_mode)

    def __call__(self, query, key, value, real_shift=None, drop_mask=None, padding_mask=None, attn_mask=None,
                 prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None):
        if self.args["input_layout"] == "TND":
            raise NotImplementedError("this stand-in gives the softmax statistics of the B-S-N layouts only")
        a = self.args
        out, row_max, row_sum = _forward(query, key, value, a["head_num"], real_shift, drop_mask, padding_mask,
                                         attn_mask, prefix, actual_seq_qlen, actual_seq_kvlen, a["keep_prob"],
                                         a["scalar_value"], a["pre_tokens"], a["next_tokens"], a["input_layout"],
                                         a["sparse_mode"])
        stats = [ops.stop_gradient(ops.tile(s, (1, 1, 1, 8))) for s in (row_max, row_sum)]
        return stats[0], stats[1], Tensor(np.zeros(()), query.dtype), out


class FlashAttentionScoreGrad:
    """The backward primitive: ``FlashAttentionScoreGrad(head_num, keep_prob, scale_value,
    pre_tokens, next_tokens, inner_precise, input_layout, sparse_mode)(query, key, value, dy,
    pse_shift, drop_mask, padding_mask, atten_mask, softmax_max, softmax_sum, softmax_in,
    attention_in, prefix, actual_seq_qlen, actual_seq_kvlen)`` returns (dq, dk, dv, dpse). It has
    no page of its own: it is held to the forward's. Not modelled: TND, pse, dropout."""

    def __init__(self, head_num, keep_prob=1.0, scale_value=1.0, pre_tokens=65536, next_tokens=65536,
                 inner_precise=1, input_layout="BSH", sparse_mode=0):
        self.args = dict(head_num=head_num, keep_prob=keep_prob, scalar_value=scale_value, pre_tokens=pre_tokens,
                         next_tokens=next_tokens, input_layout=input_layout, sparse_mode=sparse_mode)

    def __call__(self, query, key, value, dy, pse_shift=None, drop_mask=None, padding_mask=None, atten_mask=None,
                 softmax_max=None, softmax_sum=None, softmax_in=None, attention_in=None, prefix=None,
                 actual_seq_qlen=None, actual_seq_kvlen=None):
        a = self.args
        dims = contract.check_call(query, key, value, a["head_num"], pse_shift, drop_mask, padding_mask, atten_mask,
                                   prefix, actual_seq_qlen, actual_seq_kvlen, a["keep_prob"], a["scalar_value"],
                                   a["pre_tokens"], a["next_tokens"], a["input_layout"], a["sparse_mode"], _dtypes())
        if a["input_layout"] == "TND" or pse_shift is not None or a["keep_prob"] != 1.0:
            raise NotImplementedError("this stand-in's backward covers the B-S-N layouts without pse or dropout")
        for name, t, shape in (("dy", dy, query.shape), ("attention_in", attention_in, query.shape),
                               ("softmax_max", softmax_max, (dims.batch, dims.heads, dims.q_len, 8)),
                               ("softmax_sum", softmax_sum, (dims.batch, dims.heads, dims.q_len, 8))):
            if t is None or tuple(t.shape) != tuple(shape):
                raise RuntimeError(f"FlashAttentionScoreGrad: {name} must be {tuple(shape)}, got "
                                   f"{None if t is None else tuple(t.shape)}")
        layout = a["input_layout"]
        dropped = _dropped_pairs(atten_mask, dims.q_len, dims.k_len, a["sparse_mode"], a["pre_tokens"],
                                 a["next_tokens"])
        grads = _grad(*(to_bnsd(t, layout, dims.head_dim).asnumpy().astype(np.float32)
                        for t in (query, key, value, dy, attention_in)),
                      softmax_max.asnumpy()[..., :1], softmax_sum.asnumpy()[..., :1], dropped, a["scalar_value"])
        return tuple(from_bnsd(Tensor(g), layout).astype(query.dtype) for g in grads) + (
            Tensor(np.zeros(()), query.dtype),)


def _grad(q, k, v, dy, out, row_max, row_sum, dropped, scale):
    """FlashAttention-2's backward in numpy, from the forward's statistics (B, N, S1, 1):

        p = exp(scale q k^T - max) / sum over the retained pairs (0 elsewhere)
        D_i = dy_i . out_i,   ds = p (dy v^T - D),   dq = scale ds k,   dk = scale ds^T q,   dv = p^T dy

    k / v heads are shared by N1 / N2 query heads: their gradients sum over the group. A row
    whose every pair is dropped is undefined: all gradients NaN."""
    group = q.shape[1] // k.shape[1]
    kr, vr = np.repeat(k, group, 1), np.repeat(v, group, 1)
    scores = np.einsum("bnqd,bnkd->bnqk", q, kr) * scale
    p = np.where(dropped, 0.0, np.exp(scores - row_max) / row_sum)
    ds = p * (np.einsum("bnqd,bnkd->bnqk", dy, vr) - (dy * out).sum(-1, keepdims=True))
    dq = scale * np.einsum("bnqk,bnkd->bnqd", ds, kr)
    dk = scale * np.einsum("bnqk,bnqd->bnkd", ds, q)
    dv = np.einsum("bnqk,bnqd->bnkd", p, dy)
    b, n2, s2, d = k.shape
    dk, dv = (g.reshape(b, n2, group, s2, d).sum(2) for g in (dk, dv))
    if np.broadcast_to(dropped, p.shape).all(-1).any():
        dq, dk, dv = (np.full_like(g, np.nan) for g in (dq, dk, dv))
    return [g.astype(np.float32) for g in (dq, dk, dv)]
