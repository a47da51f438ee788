"""Low-precision (bf16 / fp16) kernels: native on Ascend, emulated elsewhere.

On CPU MindSpore 2.7.2 has no bf16 / fp16 kernel for matmul, mul, div, exp, softmax, gather, tile,
reductions or convolutions (only add, sub, cast, reshape, transpose, concat, split and slicing:
DESIGN §4). There the kernel layer emulates a low-precision kernel: activations stay float32
tensors holding the values the low-precision kernel would write,

    y = round(round(x) @ round(W))     round(v): v cast to the low dtype and back (nearest even)

with the products accumulated in fp32 in between: what Ascend's Cube unit does with bf16 operands
(W is a bf16 parameter, already rounded). The backward rounds the incoming gradient at the same
points (a bf16 run's activation gradients are bf16); a parameter's gradient comes back in its own
dtype. On Ascend the tensors are in the low dtype and its kernels run as they are.

Kernels with a weight compute in the weight's dtype (a module kept in fp32 computes in fp32);
weight-free ones (attention) in the process's compute dtype (mm_parallel.precision.activate).
"""

from __future__ import annotations

import functools

import mindspore as ms
from mindspore import nn

from mm_parallel.ops.device import as_type

LOW = (ms.bfloat16, ms.float16)
_compute_dtype = ms.float32


def set_compute_dtype(dtype) -> None:
    global _compute_dtype
    _compute_dtype = dtype


def compute_dtype():
    """The dtype weight-free kernels compute in (float32 unless a low precision is active)."""
    return _compute_dtype


def emulated() -> bool:
    """Whether low-precision kernels are emulated: every device but Ascend."""
    return ms.get_context("device_target") != "Ascend"


_SPLIT = float(2 ** 16 + 1)


def round_to_bf16(x):
    """float32 ``x`` rounded to bfloat16's 8 significant bits (nearest, ties to even), in float32.

    Veltkamp's split: with c = x (2^16 + 1), c - (c - x) keeps the top 24 - 16 bits of x, rounded
    to nearest. Equal to casting to bfloat16 and back (checked on 1M values over 2^-29..2^29 and
    on ties) and 9x faster on CPU, where MindSpore's bf16 casts are scalar loops (0.8 against
    7 ms on 512 x 512). |x| above ~5e33 becomes nan instead of a finite bf16 value: such a step is
    skipped as non-finite."""
    c = x * _SPLIT
    return c - (c - x)


def _round(x, dtype):
    if dtype == ms.bfloat16:
        return round_to_bf16(x)
    return x.astype(dtype).astype(ms.float32)  # fp16: the cast keeps its overflow to inf and subnormals


class _Round(nn.Cell):
    """v -> v rounded to ``dtype`` (float32 storage), in both directions (the gradient is rounded too)."""

    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def construct(self, x):
        return _round(x, self.dtype)

    def bprop(self, x, out, dout):
        return (_round(dout, self.dtype),)


@functools.lru_cache(maxsize=None)
def _rounding(dtype) -> _Round:
    return _Round(dtype)


def to_compute(x, dtype=None):
    """``x`` as a kernel computing in ``dtype`` (default: the compute dtype) takes it: rounded to
    it (emulated, float32 storage) or cast to it (Ascend); fp32 kernels take float32."""
    dtype = _compute_dtype if dtype is None else dtype
    if dtype not in LOW:
        return as_type(x, ms.float32)
    if emulated():
        return _rounding(dtype)(as_type(x, ms.float32))
    return as_type(x, dtype)


def rounded(x, dtype=None):
    """float32 ``x`` holding the values ``dtype`` (default: the compute dtype) holds, on every
    device: for kernels that take low-precision operands but compute in float32 (the reference
    attention's scores and softmax)."""
    return as_type(to_compute(x, dtype), ms.float32)


def compute_weight(weight):
    """A parameter as the kernel multiplies it: float32 when emulating (its gradient comes back in
    the parameter's dtype), itself on Ascend."""
    return as_type(weight, ms.float32) if weight.dtype in LOW and emulated() else weight


def matmul_operands(x, weight):
    """(x, weight) ready for a matmul in the weight's dtype (see the module docstring)."""
    return to_compute(x, weight.dtype), compute_weight(weight)
