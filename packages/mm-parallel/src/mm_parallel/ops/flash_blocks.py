"""One attention block and its log-sum-exp from Ascend's flash attention kernel: ring attention's block.

Ring attention (mm_parallel.context_parallel) merges the blocks of one query chunk against the
key chunks as they pass by their log-sum-exp:

    out_b = softmax(s_b) v_b,   lse_b = log sum_j exp(s_bj),   s_b = scale q k_b^T (allowed pairs)

``ops.flash_attention_score`` returns only the output, so the block calls the primitive under it,
``FlashAttentionScore``, which also returns the softmax statistics: the row max m and the sum
of exp(s - m), (B, N1, S1, 8) float32, from which lse = m + log(sum). Its own backward
differentiates the output only, and the merge needs the lse's gradient too, so the block's
backward is written out with ``FlashAttentionScoreGrad``:

    ds = p (dout v^T - D + dlse),  D_i = dout_i . out_i     (d lse_i / d s_ij = p_ij)
    dq = scale ds k,  dk = scale ds^T q,  dv = p^T dout

FlashAttentionScoreGrad computes p (dy v^T - rowsum(dy * attention_in)); the lse term rides in
one spare head column: q, k, v get a zero column (the scores and p v are unchanged), dy = [dout, 1]
and attention_in = [out, -dlse], so dy v^T = dout v^T and rowsum(dy * attention_in) = D - dlse.
The spare column comes from the padding to a multiple of 16 where the head size leaves room, else
the backward runs 16 columns wider.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops
from mindspore.ops import auto_generate

from mm_parallel.ops.device import as_type
from mm_parallel.ops.device import ones as device_ones
from mm_parallel.ops.fused_attention import causal_allowed, compressed_causal_mask, padded_head_dim, widened

_INT_MAX = 2147483647


class _FlashBlock(nn.Cell):
    """(out, lse, softmax_max, softmax_sum) of q (B, S1, N1, D) over k, v (B, S2, N2, D) in BSND,
    with the backward of the module docstring; ``dropped``: the (B, 1, S1, S2) bool mask of
    discarded pairs (sparse_mode 0), or None (causal: sparse_mode 3 and the compressed triangle;
    else no mask). The kernels take their operands in ``dtype``; the widening and cutting around
    them stay in the inputs' dtype (float32 storage where bf16 is emulated: the CPU slices no bf16)."""

    def __init__(self, heads: int, scale: float, causal: bool, dropped, dtype):
        super().__init__()
        self.sparse_mode = 3 if causal else 0
        self.heads, self.scale, self.dtype = heads, float(scale), dtype
        self.mask = compressed_causal_mask() if causal else dropped

    def _operands(self, tensors, width):
        return [as_type(widened(t, width), self.dtype) for t in tensors]

    def construct(self, q, k, v):
        head_dim = q.shape[-1]
        kernel = auto_generate.FlashAttentionScore(self.heads, 1.0, self.scale, _INT_MAX, _INT_MAX, 0, "BSND",
                                                   self.sparse_mode)
        row_max, row_sum, _, out = kernel(*self._operands((q, k, v), padded_head_dim(head_dim)), None, None, None,
                                          self.mask)
        lse = row_max[..., 0] + ops.log(row_sum[..., 0])  # (B, N1, S1)
        return as_type(out, q.dtype)[..., :head_dim], lse, row_max, row_sum

    def bprop(self, q, k, v, out, dout):
        head_dim = q.shape[-1]
        width = padded_head_dim(head_dim + 1)  # one spare column at least
        attention, row_max, row_sum = out[0], out[2], out[3]
        d_out, d_lse = dout[0], dout[1]
        batch, q_len = q.shape[0], q.shape[1]
        ones = device_ones((batch, q_len, self.heads, 1), d_out.dtype)
        spare = as_type(-d_lse.transpose(0, 2, 1).reshape(batch, q_len, self.heads, 1), attention.dtype)
        dy, attention_in = self._operands((ops.concat([d_out, ones], -1), ops.concat([attention, spare], -1)), width)
        grad = auto_generate.FlashAttentionScoreGrad(self.heads, 1.0, self.scale, _INT_MAX, _INT_MAX, 0, "BSND",
                                                     self.sparse_mode)
        grads = grad(*self._operands((q, k, v), width), dy, None, None, None, self.mask, row_max, row_sum, None,
                     attention_in)[:3]
        return tuple(as_type(g, q.dtype)[..., :head_dim] for g in grads)


def flash_block(q, k, v, scale: float, causal: bool, key_valid=None, kernel_dtype=ms.bfloat16):
    """(out float32 (B, S1, N1, D), lse float32 (B, N1, S1)) of one ring block from the kernel,
    operands in ``kernel_dtype``. ``key_valid``: host (B, S2) bool of the keys that exist (a
    sequence padded to split evenly), every query seeing at least one (the ring skips blocks of
    padding alone: a query with no key is undefined in the kernel's documentation)."""
    dropped = None
    if key_valid is not None:
        keep = np.asarray(key_valid, bool)
        allowed = keep[:, None, None, :]
        if causal:
            allowed = allowed & causal_allowed(q.shape[1], k.shape[1])
        if not allowed.any(-1).all():
            raise ValueError("a ring block in which some query has no key: skip blocks of padding alone")
        dropped, causal = Tensor(~np.broadcast_to(allowed, (q.shape[0], 1, q.shape[1], k.shape[1]))), False
    out, lse, _, _ = _FlashBlock(q.shape[2], scale, causal, dropped, kernel_dtype)(q, k, v)
    return as_type(out, ms.float32), lse
