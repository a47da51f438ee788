"""Stand-ins for Ascend's fused kernels on CPU, each held to its MindSpore 2.7.2 page.

Each function has the signature of the MindSpore 2.7 call it replaces and does what that call's
API page says (cited per function; the docstrings of the installed mindspore 2.7.2 are the same
text), computed independently of mm_parallel's reference kernels in plain CPU MindSpore ops, so
autodiff gives the backward. Arguments the page forbids are refused with the error type the
page names, quoting the line they break. Flash attention, whose page is the longest, has modules
of its own: flash_attention_contract (the restrictions) and flash_attention (the computation,
the primitive with its softmax statistics and its backward).

One deliberate widening: the flash attention page admits only float16 / bfloat16, and the CPU has
no bf16 / fp16 arithmetic kernels (DESIGN §4). ``allow_float32(True)`` lets the flash attention
stand-ins take float32 too, so whole models run through the fused branches in float32 and are
compared with the reference path at fp32 precision; without it float32 is refused as on Ascend
(and the mm kernels route float32 to the reference path, as they must there). A bf16 run passes
the kernels real bfloat16 tensors (mm_parallel.ops.fused_attention casts to them).
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from mm_parallel.testing import flash_attention
from mm_parallel.testing import flash_attention_contract as contract
from mm_parallel.testing.flash_attention import FlashAttentionScore, FlashAttentionScoreGrad, flash_attention_score

__all__ = ["FlashAttentionScore", "FlashAttentionScoreGrad", "allow_float32", "flash_attention_score",
           "grouped_matmul", "rms_norm", "rotary_position_embedding", "swiglu"]


def allow_float32(allowed: bool) -> None:
    """Whether flash attention, documented for half precision only, also takes float32 (module docstring)."""
    flash_attention.allow_float32(allowed)


def _require(ok, error, kernel, line, detail):
    """flash_attention_contract.require for ``kernel``'s page (the refusal quotes ``line``)."""
    contract.require(ok, error, line, detail, kernel)


def _check_dtype(kernel, line, what, x, allowed):
    _require(isinstance(x, Tensor), TypeError, kernel, line, f"{what} is a {type(x).__name__}, not a Tensor")
    _require(x.dtype in allowed, TypeError, kernel, line, f"{what} has dtype {x.dtype}")


# -- rms_norm, rotary_position_embedding, swiglu --------------------------------------------------
# Quoted lines: " ... " marks wording the tested releases' pages differ in where the rule does not
# (2.9.0 on: "the same as", "larger", "Supported layout", "D is Even", "32-byte"; docs/versions.md).

RMS = "rms_norm"
RMS_X = "x (Tensor): Input data of RmsNorm. Support data type: float16, float32, bfloat16."
RMS_GAMMA = "gamma (Tensor): Learnable parameter gamma . Support data type: float16, float32, bfloat16."
RMS_SAME = "TypeError: If data type of `x` is not the same ... the data type of `gamma`."
RMS_EPS = "ValueError: If `epsilon` is not a float between 0 and 1."
RMS_RANK = "ValueError: If the rank of `gamma` is la ... ger than the rank of `x`."


def rms_norm(x, gamma, epsilon=1e-6):
    """mindspore.ops.rms_norm (https://www.mindspore.cn/docs/en/r2.7.2/api_python/ops/mindspore.ops.rms_norm.html):
    y = x / sqrt(mean(x^2) + eps) * gamma over gamma's trailing dims; returns (y in x's dtype,
    rstd float32 with those dims kept as 1)."""
    _check_dtype(RMS, RMS_X, "x", x, (ms.float16, ms.float32, ms.bfloat16))
    _check_dtype(RMS, RMS_GAMMA, "gamma", gamma, (ms.float16, ms.float32, ms.bfloat16))
    _require(x.dtype == gamma.dtype, TypeError, RMS, RMS_SAME, f"x is {x.dtype}, gamma {gamma.dtype}")
    _require(isinstance(epsilon, float) and 0.0 < epsilon <= 1.0, ValueError, RMS, RMS_EPS, f"epsilon {epsilon!r}")
    _require(gamma.ndim <= x.ndim, ValueError, RMS, RMS_RANK, f"gamma {tuple(gamma.shape)}, x {tuple(x.shape)}")
    axes = tuple(range(x.ndim - gamma.ndim, x.ndim))
    h = x.astype(ms.float32)
    rstd = ops.rsqrt(ops.mean(h * h, axes, keep_dims=True) + epsilon)
    return (h * rstd * gamma.astype(ms.float32)).astype(x.dtype), rstd


ROPE = "rotary_position_embedding"
ROPE_X = "x (Tensor): 4D tensor, with float16, bfloat16 or float32 data type."
ROPE_TABLE = "cos (Tensor): 4D constant, has the same type as `x` , in range of [-1, 1]."
ROPE_MODE = "TypeError: If `mode` is not an int."
ROPE_D = "D < 896 and D is ... Even. B, N < 1000;"
ROPE_LAYOUT = "Support ... layout for different values of `x`"
ROPE_BNSD = ("When the layout is BNSD, B * N > 8S and D is 32-byte ... alignment, the performance is poor. "
             "Therefore, this interface cannot be called.")


def _rope_layouts(x_shape, table_shape, mode):
    """The readings of x ("BNSD", "BSND", "SBND") whose row of the page's table its cos / sin fit;
    x's dims d0, d1, d2, D. Tables of x's own shape fit every reading of mode 0."""
    d0, d1, d2, d = x_shape
    if mode == 0:
        forms = {"BNSD": [(1, 1, d2, d), (d0, 1, d2, d), x_shape], "BSND": [(1, d1, 1, d), (d0, d1, 1, d), x_shape],
                 "SBND": [(d0, 1, 1, d), (d0, d1, 1, d), x_shape]}
    else:
        forms = {"BNSD": [(1, 1, d2, d)], "BSND": [(1, d1, 1, d)], "SBND": [(d0, 1, 1, d)]}
    return [layout for layout, shapes in forms.items() if tuple(table_shape) in shapes]


def _rope_reading_breaks(layout, x_shape, itemsize):
    """The line of the page x read as ``layout`` breaks, or None: B, N < 1000, and not the BNSD
    form the note forbids (B * N > 8 S with D 32-byte aligned)."""
    b, n, seq = {"BNSD": (x_shape[0], x_shape[1], x_shape[2]), "BSND": (x_shape[0], x_shape[2], x_shape[1]),
                 "SBND": (x_shape[1], x_shape[2], x_shape[0])}[layout]
    if b >= 1000 or n >= 1000:
        return ROPE_D
    if layout == "BNSD" and b * n > 8 * seq and x_shape[-1] * itemsize % 32 == 0:
        return ROPE_BNSD
    return None


def rotary_position_embedding(x, cos, sin, mode=0):
    """mindspore.ops.rotary_position_embedding
    (https://www.mindspore.cn/docs/en/r2.7.2/api_python/ops/mindspore.ops.rotary_position_embedding.html):
    out = x cos + rotate(x) sin over the last dim; mode 0 rotate_half (cat(-x2, x1)), mode 1
    rotate_interleaved (pairs (x[2i], x[2i+1]) -> (-x[2i+1], x[2i])). Tables in the layouts the
    page's table lists (mode 1: shared by the batch and the heads)."""
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        _require(isinstance(t, Tensor), TypeError, ROPE, f"TypeError: If `{name}` is not a Tensor.",
                 f"{name} is a {type(t).__name__}")
    _require(isinstance(mode, int) and mode in (0, 1), TypeError, ROPE, ROPE_MODE, f"mode {mode!r}")
    _check_dtype(ROPE, ROPE_X, "x", x, (ms.float16, ms.bfloat16, ms.float32))
    _require(x.ndim == 4, ValueError, ROPE, ROPE_X, f"x is {tuple(x.shape)}")
    _require(cos.dtype == x.dtype and sin.dtype == x.dtype and cos.ndim == 4, TypeError, ROPE, ROPE_TABLE,
             f"cos {cos.dtype} {tuple(cos.shape)}, sin {sin.dtype}, x {x.dtype}")
    layouts = _rope_layouts(tuple(x.shape), tuple(cos.shape), mode)
    _require(tuple(sin.shape) == tuple(cos.shape) and bool(layouts), ValueError, ROPE, ROPE_LAYOUT,
             f"cos / sin {tuple(cos.shape)} for x {tuple(x.shape)} in mode {mode}")
    d = x.shape[-1]
    _require(d % 2 == 0 and d < 896, ValueError, ROPE, ROPE_D, f"x {tuple(x.shape)}")
    # tables of x's own shape fit several readings, each the same elementwise product: the call is
    # refused only when every reading breaks a line
    broken = [_rope_reading_breaks(layout, tuple(x.shape), 4 if x.dtype == ms.float32 else 2) for layout in layouts]
    _require(None in broken, ValueError, ROPE, broken[0], f"x {tuple(x.shape)} read as {layouts}")
    _require(bool(np.all(np.abs(cos.astype(ms.float32).asnumpy()) <= 1) and
                  np.all(np.abs(sin.astype(ms.float32).asnumpy()) <= 1)), ValueError, ROPE, ROPE_TABLE,
             "a cos / sin entry outside [-1, 1]")
    half = d // 2
    if mode == 0:
        rotated = ops.concat([-x[..., half:], x[..., :half]], -1)
    else:
        pairs = x.reshape(x.shape[:-1] + (half, 2))
        rotated = ops.stack([-pairs[..., 1], pairs[..., 0]], -1).reshape(x.shape)
    return x * cos + rotated * sin


SWIGLU = "swiglu"
SWIGLU_DTYPE = "TypeError: If dtype of `input` is not float16, float32 or bfloat16."
SWIGLU_EVEN = "RuntimeError: If the dimension specified by `dim` is not divisible by 2."


def swiglu(input, dim=-1):  # noqa: A002 - the documented argument name
    """mindspore.ops.swiglu (https://www.mindspore.cn/docs/en/r2.7.2/api_python/ops/mindspore.ops.swiglu.html):
    Swish(a) * b with a, b the first and second halves of ``input`` along ``dim``."""
    _check_dtype(SWIGLU, SWIGLU_DTYPE, "input", input, (ms.float16, ms.float32, ms.bfloat16))
    _require(isinstance(dim, int), TypeError, SWIGLU, "dim (int, optional): the axis to split the input. It must "
             "be int.", f"dim {dim!r}")
    _require(input.shape[dim] % 2 == 0, RuntimeError, SWIGLU, SWIGLU_EVEN, f"dim {dim} of {tuple(input.shape)}")
    a, b = ops.split(input, input.shape[dim] // 2, dim)
    return a * ops.sigmoid(a) * b


# -- grouped_matmul --------------------------------------------------------------------------------

GMM = "grouped_matmul"
GMM_MODES = "split_item (int): Splitting input mode. Only support 0 and 3."
GMM_PAIR = "TypeError: when `split_item` is 3, `group_type` is not 0."
GMM_LIST = "TypeError: when `split_item` is 3, `group_list` is None."
GMM_SPLIT_0 = ("0 -1 None The length of x is n, tensor in x must be 2D-6D. The length of weight is n, tensor in "
               "weight must be 2D.")
GMM_SPLIT_3 = ("3 0 1D Tensor The length of x is 1, tensor in x must be 2D. The length of weight is 1, tensor in "
               "weight must be 3D. (group_list.shape)[0] must be equal to (weight.shape)[0]")
GMM_FP16 = "Parameter limitations 2 Non-quant tyep table"  # x, weight, bias, y: Float16
GMM_FP32 = "Parameter limitations 3 Only in split_item=3, group_type=0"  # x, weight, bias, y: Float32
GMM_GROUPS = "group_list (Tensor, optional): Grouping positions for the M-axis of input x. Supported dtypes: Int64"


def grouped_matmul(x, weight, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                   group_list=None, split_item=0, group_type=-1, transpose_a=False, transpose_b=False):
    """mindspore.ops.auto_generate.grouped_matmul (the GroupedMatmul page,
    https://www.mindspore.cn/docs/en/r2.7.2/api_python/ops/mindspore.ops.GroupedMatmul.html), the
    non-quantised forms:
        split_item 0, group_type -1: y_i = x_i weight_i (+ bias_i) for each pair of the lists (float16)
        split_item 3, group_type 0:  one x (M, K), one weight (E, K, N); rows [g_{e-1}, g_e) of x
                                     times weight[e], g = group_list (int64 cumulative, E entries;
                                     float16 or float32)
    transpose_b reads weight[e] as (N, K). Returns a list. (The page's table says group_list's last
    value equals weight's first dim; its own example ends at x's rows, as the grouping means: that
    is what is checked.)"""
    _require(split_item in (0, 3) and group_type in (-1, 0), TypeError, GMM, GMM_MODES,
             f"split_item {split_item}, group_type {group_type}")
    _require((split_item == 3) == (group_type == 0), TypeError, GMM, GMM_PAIR,
             f"split_item {split_item}, group_type {group_type}")
    if any(t is not None for t in (scale, offset, antiquant_scale, antiquant_offset)) or transpose_a:
        raise NotImplementedError("this stand-in covers the non-quantised forms without transpose_a")
    xs, ws = list(x), list(weight)
    if split_item == 0:
        for t in xs + ws + list(bias or []):
            _check_dtype(GMM, GMM_FP16, "x / weight / bias", t, (ms.float16,))
        _require(group_list is None and len(xs) == len(ws) and all(2 <= a.ndim <= 6 for a in xs)
                 and all(w.ndim == 2 for w in ws), TypeError, GMM, GMM_SPLIT_0,
                 f"{len(xs)} x of ranks {[a.ndim for a in xs]}, {len(ws)} weights of ranks {[w.ndim for w in ws]}")
        biases = list(bias) if bias is not None else [None] * len(xs)
        outs = [ops.matmul(a, w.T if transpose_b else w) for a, w in zip(xs, ws)]
        return [o if c is None else o + c for o, c in zip(outs, biases)]
    for t in xs + ws:
        _check_dtype(GMM, GMM_FP32, "x / weight", t, (ms.float16, ms.float32))
    _require(len({t.dtype for t in xs + ws}) == 1, TypeError, GMM, GMM_FP32, "x and weight differ in dtype")
    _require(group_list is not None, TypeError, GMM, GMM_LIST, "no group_list")
    if bias is not None:
        raise NotImplementedError("the differentiable form (split_item 3, group_type 0) takes no bias")
    _require(len(xs) == 1 and len(ws) == 1 and xs[0].ndim == 2 and ws[0].ndim == 3, ValueError, GMM, GMM_SPLIT_3,
             f"{len(xs)} x, {len(ws)} weights")
    _require(isinstance(group_list, Tensor) and group_list.dtype == ms.int64 and group_list.ndim == 1, TypeError,
             GMM, GMM_GROUPS, f"group_list {getattr(group_list, 'dtype', type(group_list).__name__)}")
    ends = contract.host_ints(group_list)
    a, w = xs[0], ws[0]
    _require(len(ends) == w.shape[0] and ends[-1] == a.shape[0] and not np.any(np.diff([0] + ends) < 0), ValueError,
             GMM, GMM_SPLIT_3, f"group_list {ends} for weight {tuple(w.shape)} and x rows {a.shape[0]}")
    parts, start = [], 0
    for e, end in enumerate(ends):
        if end > start:
            parts.append(ops.matmul(a[start:end], w[e].T if transpose_b else w[e]))
        start = end
    return [ops.concat(parts, 0) if len(parts) > 1 else parts[0]]
