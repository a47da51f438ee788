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

Packed segments on the reference path: a batch of one whose segments are contiguous runs (the
vision towers' windows and frames, the audio tower's chunks, cu_seqlens packing) runs as a batch
of segments padded to the longest one, a key padding mask hiding the padding (`segment_blocks`):
the scores are S x L^2 instead of N^2 (N packed positions in S segments of at most L), the
same allowed pairs. Measured (benchmarks/plan_activation_memory.py, case qwen2_5_omni: a 30 s
audio per sample, 1500 positions in chunks of 100, batch 2, fp32): a step's activations 2470 ->
1069 MiB.

Scores and softmax are computed in float32; q, k, v, the probabilities and the output are in the
compute dtype (mm_parallel.ops.low_precision).
"""

from __future__ import annotations

from typing import Optional

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mm_parallel.ops import native
from mm_parallel.ops.device import as_type, host_array, ones, tiled_to, use_fused, with_zero_row
from mm_parallel.ops.fused_attention import causal_allowed, flash_attention, has_kernel_form, padded_runs
from mm_parallel.ops.low_precision import LOW, compute_dtype, rounded, to_compute

# The dtypes flash_attention_score takes (its MindSpore 2.7 page): float32 goes to the reference
# path. A list, so the CPU stand-ins (mm_parallel.testing) can widen it to run models in float32.
FLASH_ATTENTION_DTYPES = [ms.float16, ms.bfloat16]
_MASKED = -1e30
_TINY = 1e-30
_matmul_nt = ops.BatchMatMul(transpose_b=True)
_matmul_nn = ops.BatchMatMul()
_matmul_tn = ops.BatchMatMul(transpose_a=True)


def segment_ids_from_cu_seqlens(cu_seqlens, total: int):
    """(1, total) segment ids from flash-attn's cumulative boundaries [0, l0, l0+l1, ..., total]."""
    return Tensor(_host_segment_ids(cu_seqlens, total))


def _host_segment_ids(cu_seqlens, total: int) -> np.ndarray:
    """`segment_ids_from_cu_seqlens` as a numpy array: attention reads segment ids on the host (the
    reference mask, the fused kernel's actual_seq_qlen), so it keeps them there."""
    bounds = host_array(cu_seqlens, np.int64)
    if bounds.ndim != 1 or bounds[0] != 0 or bounds[-1] != total or np.any(np.diff(bounds) < 0):
        raise ValueError(f"cu_seqlens must rise from 0 to the packed length {total}, got {bounds.tolist()}")
    return np.repeat(np.arange(len(bounds) - 1, dtype=np.int32), np.diff(bounds))[None, :]


def segment_blocks(segments) -> Optional[tuple]:
    """([(gather (S, L): the packed row of each block slot, N where it is padding; valid (S, L)
    bool)] one padded batch per group of runs, scatter (N,): the slot of each packed row in the
    groups' flattened blocks, one after another) for (1, N) segment ids that are contiguous runs;
    None when a segment is in pieces or the blocks would hold more than half the N^2 scores.

    Runs are grouped longest first, a group of longest run L0 taking every run with L^2 >= L0^2 / 2
    (each run's padded scores at most twice its own): one group for equal windows and frames, a
    few for a packed row of long-tailed samples, whose one padded batch would cost S x Lmax^2
    (measured: benchmarks/packing.py)."""
    ids = np.asarray(segments).reshape(-1)
    n = ids.size
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    if len(np.unique(ids[starts])) != len(starts):  # a segment in pieces: leave it to the mask
        return None
    lengths = np.diff(np.r_[starts, n])
    squares = lengths.astype(np.int64) ** 2
    groups, current = [], []
    for run in np.argsort(-lengths, kind="stable"):
        if current and 2 * squares[run] < squares[current[0]]:
            groups.append(current)
            current = []
        current.append(run)
    groups.append(current)
    if 2 * sum(len(g) * int(squares[g[0]]) for g in groups) > n * n:
        return None
    blocks, slots, offset = [], np.empty(n, np.int64), 0
    for group in groups:
        group = sorted(group)  # the rows' own order inside a group
        gather, valid, scatter = padded_runs(starts[group], lengths[group], n)
        blocks.append((gather, valid))
        slots[gather.reshape(-1)[scatter]] = offset + scatter
        offset += gather.size
    return blocks, slots


def _attention_in_blocks(q, k, v, blocks, causal: bool, scale: float):
    """`attention` of a packed batch of one, segment by segment as padded batches (`segment_blocks`)."""
    groups, scatter = blocks
    outs = []
    for gather, valid in groups:
        count, longest = gather.shape
        index = Tensor(gather.reshape(-1).astype(np.int32))

        def to_blocks(x):
            return ops.gather(with_zero_row(x[0]), index, 0).reshape((count, longest) + tuple(x.shape[2:]))

        # causal: a run's padding comes after every key its real queries may see, so the causal
        # mask alone hides it (and the padded queries' rows are never gathered back)
        padding = None if causal or valid.all() else valid
        out = attention(to_blocks(q), to_blocks(k), to_blocks(v), causal=causal, scale=scale,
                        key_padding_mask=padding)
        outs.append(out.reshape((count * longest,) + tuple(out.shape[2:])))
    out = ops.concat(outs, 0) if len(outs) > 1 else outs[0]
    return ops.gather(out, Tensor(scatter.astype(np.int32)), 0)[None]


def _allowed(batch, q_len, k_len, causal, key_padding_mask, q_segments, k_segments):
    """(batch or 1, 1, q_len, k_len) bool of allowed pairs, or None when every pair is allowed.

    Built on the host with numpy: masks are small next to the scores, their inputs are host data
    (positions, padding, packing boundaries), and the device ops they replace (casts, comparisons,
    a relu of |q_id - k_id|) cost ~0.3-0.7 ms each on CPU, per attention call."""
    mask = None
    if causal:
        mask = causal_allowed(q_len, k_len)[None, None]
    if key_padding_mask is not None:
        keep = host_array(key_padding_mask)
        if keep.shape != (batch, k_len):
            raise ValueError(f"key_padding_mask must be (batch, k_len) = {(batch, k_len)}, got {keep.shape}")
        keep = (keep != 0)[:, None, None, :]
        mask = keep if mask is None else mask & keep
    if q_segments is not None:
        qs, ks = host_array(q_segments), host_array(k_segments)
        if qs.shape[-1] != q_len or ks.shape[-1] != k_len:
            raise ValueError(f"segment ids {qs.shape} / {ks.shape} do not match q_len {q_len} / k_len {k_len}")
        same = qs.reshape(-1, 1, q_len, 1) == ks.reshape(-1, 1, 1, k_len)
        mask = same if mask is None else mask & same
    return mask


class _Softmax(nn.Cell):
    """softmax over the last dim with the backward dx = y (dy - sum_j dy_j y_j) written out: the
    row sum as a matmul with ones and the subtraction on tiled operands. MindSpore's own softmax
    backward broadcasts, which on CPU made it 2x slower (51 -> 27 ms on 8 x 512 x 512 scores)."""

    def construct(self, scores):
        return ops.softmax(scores, -1)

    def bprop(self, scores, out, dout):
        row = ops.matmul(dout * out, ones((out.shape[-1], 1)))
        return (out * (dout - tiled_to(row, out.shape)),)


_softmax = _Softmax()


def _core_backward(q, k, v, o, probs, do):
    """(dq, dk, dv, ds) of out = softmax(q k^T + mask) v, FlashAttention's way:

        dv = p^T do,  dp = do v^T,  ds = p (dp - D),  D_i = sum_j dp_ij p_ij = do_i . out_i
        dq = ds k,    dk = ds^T q,  dmask = ds

    D from do . out is a (rows, head_dim) product, where the softmax's own backward takes two more
    passes over the (rows, keys) probabilities (4 x 2048 x 2048 per Wan self-attention)."""
    row = ops.matmul(do * o, ones((o.shape[-1], 1)))
    dprobs = _matmul_nt(do, v)
    scores_gradient = native.operator("attention", "ScoresGradient") if probs.dtype == ms.float32 else None
    if scores_gradient is not None:  # one pass over the (rows, keys) tensors, not three
        ds = scores_gradient(probs, dprobs, row)
    else:
        ds = probs * (dprobs - tiled_to(row, probs.shape))
    return _matmul_nn(ds, k), _matmul_tn(ds, q), _matmul_tn(probs, do), ds


class _NativeSwapSeqHeads(nn.Cell):
    """x.transpose(0, 2, 1, 3) as a multi-threaded copy (mm_parallel.ops.native, layout.cc): 4.6 ->
    ~1 ms on a (1, 2048, 4, 128) query; the swap is its own inverse, so it is its backward too."""

    def __init__(self, swap):
        super().__init__()
        self.swap = swap

    def construct(self, x):
        return self.swap(x)

    def bprop(self, x, out, dout):
        return (self.swap(dout),)


def _native_swap():
    swap = native.operator("layout", "SwapAxes12", "dims_1_2_swapped")
    return None if swap is None else _NativeSwapSeqHeads(swap)


def _swap_seq_heads(x):
    """(batch, seq, heads, dim) <-> (batch, heads, seq, dim): native on float32 when it builds."""
    fused = native.cell("swap_seq_heads", _native_swap) if x.dtype == ms.float32 else None
    return x.transpose(0, 2, 1, 3) if fused is None else fused(x)


def _row_softmax(scores):
    """softmax over the last dim, for the cores' forwards: native (one pass per row, 17 -> ~8 ms on
    4 x 2048 x 2048 scores) when its kernel builds, else MindSpore's."""
    softmax = native.operator("attention", "Softmax") if scores.dtype == ms.float32 else None
    return ops.softmax(scores, -1) if softmax is None else softmax(scores)


class _AttentionCore(nn.Cell):
    """(out, probs) = (softmax(q k^T) v, the probabilities) over (..., rows, head_dim) operands, q
    already scaled, with the backward written out (`_core_backward`); probs is an output only so
    the backward has it."""

    def construct(self, q, k, v):
        probs = _row_softmax(_matmul_nt(q, k))
        return _matmul_nn(probs, v), probs

    def bprop(self, q, k, v, out, dout):
        return _core_backward(q, k, v, out[0], out[1], dout[0])[:3]


class _MaskedAttentionCore(nn.Cell):
    """`_AttentionCore` with additive scores (mask, bias) in the scores' shape; their gradient is ds."""

    def construct(self, q, k, v, additive):
        probs = _row_softmax(_matmul_nt(q, k) + additive)
        return _matmul_nn(probs, v), probs

    def bprop(self, q, k, v, additive, out, dout):
        return _core_backward(q, k, v, out[0], out[1], dout[0])


_attention_core, _masked_attention_core = _AttentionCore(), _MaskedAttentionCore()


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
        segment_ids = _host_segment_ids(cu_seqlens, q_len)
    if segment_ids is not None and kv_segment_ids is None:
        if q_len != k_len:
            raise ValueError("segment_ids alone need q_len == k_len; pass kv_segment_ids for the keys")
        kv_segment_ids = segment_ids
    scale = head_dim ** -0.5 if scale is None else scale
    if use_fused() and not return_lse and bias is None and takes_kernel(q):
        return fused_attention(q, k, v, scale, causal, key_padding_mask, segment_ids, kv_segment_ids)
    if segment_ids is not None and batch == 1 and key_padding_mask is None and bias is None and not return_lse:
        segments = host_array(segment_ids)  # read once: on a device each read is a copy to the host
        same_keys = kv_segment_ids is segment_ids or np.array_equal(host_array(kv_segment_ids), segments)
        blocks = segment_blocks(segments) if same_keys else None
        if blocks is not None:
            return _attention_in_blocks(q, k, v, blocks, causal, scale)
    mask = _allowed(batch, q_len, k_len, causal, key_padding_mask, segment_ids, kv_segment_ids)

    dtype = q.dtype
    # Grouped-query attention without copies of the keys and values: the query heads kv head j
    # serves (j*g .. j*g+g-1) become the rows of one (g*q_len, head_dim) matrix, so one batched
    # matmul per kv head covers the group, and (b, kv, g*q, k) scores are the (b, h, q, k) ones.
    grouped = (batch, kv_heads, heads // kv_heads * q_len)
    # operands in the compute dtype (rounded to bf16 in an emulated bf16 run); scores, softmax and lse in float32
    low = compute_dtype() in LOW
    qh = _swap_seq_heads(rounded(q) * scale).reshape(grouped + (head_dim,))  # scale q, not scores
    kh = _swap_seq_heads(rounded(k))
    vh = _swap_seq_heads(rounded(v))
    shape = (batch, heads, q_len, k_len)
    if not return_lse and not low:  # the common case: the core whose backward is written out
        out = _attention_core_of(qh, kh, vh, bias, mask, shape)
    else:
        out, row_max, total = _attention_reference(qh, kh, vh, bias, mask, return_lse, low, shape)
    out = out.reshape(batch, heads, q_len, head_dim)
    if mask is not None and _rows_may_be_empty(causal, q_len, k_len, key_padding_mask, segment_ids):
        some_key = mask.any(-1, keepdims=True).astype(np.float32)
        if not some_key.all():  # zeros where no key is allowed
            out = out * tiled_to(Tensor(some_key), out.shape)
    out = as_type(_swap_seq_heads(out), dtype)
    if low:
        out = to_compute(out)
    if not return_lse:
        return out
    return out, (row_max + ops.log(total)).squeeze(-1)


def _additive_scores(bias, mask, shape):
    """bias (float scores) plus the mask's 0 / -1e30, as one float32 tensor of the scores' ``shape``
    (batch, heads, q_len, k_len), or None when there is neither."""
    extra = None
    if bias is not None:
        extra = tiled_to(as_type(bias, ms.float32), shape)
    if mask is not None:
        masked = tiled_to(Tensor(np.where(mask, 0.0, _MASKED).astype(np.float32)), shape)
        extra = masked if extra is None else extra + masked
    return extra


def _attention_core_of(qh, kh, vh, bias, mask, shape):
    """softmax(q k^T + bias + mask) v on the grouped operands, through the cores whose backward
    is written out; (batch, kv_heads, groups * q_len, head_dim)."""
    extra = _additive_scores(bias, mask, shape)
    if extra is None:
        return _attention_core(qh, kh, vh)[0]
    return _masked_attention_core(qh, kh, vh, extra.reshape(qh.shape[:-1] + (kh.shape[-2],)))[0]


def _attention_reference(qh, kh, vh, bias, mask, return_lse, low, shape):
    """The same attention by autodiff of its steps: the log-sum-exp (ring attention) and low
    precision (probabilities rounded to the compute dtype) need them. (out, row_max, row sums);
    the last two None without ``return_lse``."""
    grouped, k_len = qh.shape[:-1], shape[-1]
    row_max = total = None
    scores = _matmul_nt(qh, kh).reshape(shape)
    extra = _additive_scores(bias, mask, shape)
    if extra is not None:
        scores = scores + extra
    if not return_lse:
        probs = _softmax(scores)
        out = _matmul_nn((rounded(probs) if low else probs).reshape(grouped + (k_len,)), vh)
    else:
        # The max only keeps exp in range; lse = m + log sum exp(s - m) has the right gradient
        # (softmax) with m held constant.
        row_max = ops.stop_gradient(ops.amax(scores, -1, True))  # Tensor.max reads the host
        weights = ops.exp(scores - tiled_to(row_max, scores.shape))
        total = ops.maximum(ops.matmul(weights, ones((k_len, 1))), _TINY)  # row sums
        weights = rounded(weights) if low else weights
        out = _matmul_nn(weights.reshape(grouped + (k_len,)), vh).reshape(shape[:3] + (vh.shape[-1],)) / total
    return out, row_max, total


def _rows_may_be_empty(causal, q_len, k_len, key_padding_mask, segment_ids) -> bool:
    """Whether some query may have no allowed key (then its softmax row must become zeros)."""
    return key_padding_mask is not None or segment_ids is not None or (causal and q_len > k_len)


def kernel_dtype(q):
    """The dtype attention's operands have on the device: the compute dtype under a low precision
    (bf16 tensors on Ascend; float32 storage holding bf16 values when emulated), else q's."""
    return compute_dtype() if compute_dtype() in LOW else q.dtype


def takes_kernel(q) -> bool:
    """Whether flash_attention_score computes this attention: its dtype (half precision; fp32
    only on the stand-ins' widening) and heads within what its page admits."""
    return kernel_dtype(q) in FLASH_ATTENTION_DTYPES and has_kernel_form(q.shape[2], q.shape[3])


def fused_attention(q, k, v, scale, causal, key_padding_mask, q_segments, k_segments):
    """The same attention from Ascend's flash_attention_score, without an S x S mask where the
    kernel has a form for the case (mm_parallel.ops.fused_attention says which)."""
    return flash_attention(q, k, v, scale, causal, key_padding_mask, q_segments, k_segments,
                           lambda: _allowed(q.shape[0], q.shape[1], k.shape[1], causal, key_padding_mask,
                                            q_segments, k_segments), kernel_dtype(q))
