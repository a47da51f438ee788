"""Normalisations: layer_norm and rms_norm, computed in float32 whatever the input dtype."""

import functools

import mindspore as ms
from mindspore import Tensor, nn, ops

from mm_parallel.ops import native
from mm_parallel.ops.device import as_type, ones, tiled_to, use_fused
from mm_parallel.ops.low_precision import LOW, compute_dtype, to_compute


def in_input_dtype(out, dtype):
    """The normalised values back in the input's dtype. Under a low precision the input's dtype
    is the compute dtype (float32 storage when emulated): the values are rounded to it."""
    out = as_type(out, dtype)
    return to_compute(out) if compute_dtype() in LOW else out


class _Standardize(nn.Cell):
    """(n, r): n = (h - mean(h)) r, r = 1 / sqrt(var(h) + eps) over the last dim (biased variance),
    with the backward written out from n and r alone:

        dh = r (dn - mean(dn) - n mean(dn n))

    row means as matmuls with ones, products on tiled operands. Autodiff of the forward's chain
    (two row means, centring, square, rsqrt, their tiles) costs ~2x more ops on CPU. ``r`` is an
    output only so the backward has it; the callers use n."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def construct(self, h):
        hidden = h.shape[-1]
        column = ones((hidden, 1))
        centred = h - tiled_to(ops.matmul(h, column) * (1.0 / hidden), h.shape)
        r = ops.rsqrt(ops.matmul(ops.square(centred), column) * (1.0 / hidden) + self.eps)
        return centred * tiled_to(r, h.shape), r

    def bprop(self, h, out, dout):
        n, r = out
        dn = dout[0]
        hidden = n.shape[-1]
        column = ones((hidden, 1))
        mean_dn = ops.matmul(dn, column) * (1.0 / hidden)
        mean_dn_n = ops.matmul(dn * n, column) * (1.0 / hidden)
        return (tiled_to(r, n.shape) * (dn - tiled_to(mean_dn, n.shape) - n * tiled_to(mean_dn_n, n.shape)),)


class _NativeRowNormalise(nn.Cell):
    """(n, r) of `_Standardize` (``Standardize``) or of rms_norm's scaling n = h r (``RmsScale``),
    each direction one C++ pass per row (mm_parallel.ops.native, norms.cc); the backward, written
    out as `_Standardize`'s, takes n, r and dn."""

    def __init__(self, kind: str, eps: float):
        super().__init__()
        self.forward = native.operator("norms", kind, "rows_and_row_scale")
        self.backward = native.operator("norms", kind + "Backward")
        self.eps = Tensor([eps], ms.float32)

    def construct(self, h):
        return self.forward(h, self.eps)

    def bprop(self, h, out, dout):
        return (self.backward(out[0], out[1], dout[0]),)


def _native_row_normalise(kind: str, eps: float):
    """The native (n, r) Cell of ``kind`` when native kernels build, else None."""
    forward = native.operator("norms", kind, "rows_and_row_scale")
    if forward is None or native.operator("norms", kind + "Backward") is None:
        return None
    return _NativeRowNormalise(kind, eps)


@functools.lru_cache(maxsize=None)
def _standardize(eps: float, allow_native: bool = True) -> nn.Cell:
    """The (n, r) Cell of layer norm's standardisation: native when it builds, else written out."""
    return (allow_native and _native_row_normalise("Standardize", eps)) or _Standardize(eps)


@functools.lru_cache(maxsize=None)
def _rms_scale(eps: float):
    """The native (n = h r, r) Cell of rms_norm, or None (the operator-by-operator path)."""
    return _native_row_normalise("RmsScale", eps)


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim (biased variance).

    On CPU written out (`_Standardize`) with the row means as matmuls with ones and same-shape
    products (as rms_norm): MindSpore's LayerNorm kernels took 8 ms forward / 30 ms backward on
    2048 x 512."""
    dtype = x.dtype
    hidden = x.shape[-1]
    if use_fused():
        weight = ops.ones((hidden,), ms.float32) if weight is None else as_type(weight, ms.float32)
        bias = ops.zeros((hidden,), ms.float32) if bias is None else as_type(bias, ms.float32)
        layer_norm = ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1, epsilon=eps)
        out = layer_norm(as_type(x, ms.float32), weight, bias)[0]
        return as_type(out, dtype)
    h = as_type(x, ms.float32)
    out = _standardize(float(eps), native.enabled())(h)[0]
    affine = (1,) * (h.ndim - 1) + (hidden,)
    if weight is not None:
        out = out * tiled_to(as_type(weight, ms.float32).reshape(affine), h.shape)
    if bias is not None:
        out = out + tiled_to(as_type(bias, ms.float32).reshape(affine), h.shape)
    return in_input_dtype(out, dtype)


def rms_scaled(h, eps: float):
    """h / sqrt(mean(h^2) + eps) over the last dim, operator by operator: the mean of squares as a
    matmul with ones and every product on tiled operands (on CPU both run 2-4x faster than a
    last-dim reduction and broadcasting; a train step's norms: 22 -> 11 ms)."""
    mean_square = ops.matmul(ops.square(h), ones((h.shape[-1], 1))) * (1.0 / h.shape[-1])
    return h * tiled_to(ops.rsqrt(mean_square + eps), h.shape)


def rms_norm(x, weight=None, eps: float = 1e-6):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim.

    As transformers' Qwen2RMSNorm: normalise in float32, cast back to the input dtype, then scale.
    (A bf16 run's input dtype is bf16: emulated, the normalised values are rounded to it.)
    """
    if use_fused() and weight is not None:  # the kernel takes x and gamma in one dtype
        return ops.rms_norm(x, as_type(weight, x.dtype), float(eps))[0]
    dtype = x.dtype
    h = as_type(x, ms.float32)
    hidden = h.shape[-1]
    scale = _rms_scale(float(eps)) if native.enabled() else None
    h = in_input_dtype(rms_scaled(h, eps) if scale is None else scale(h)[0], dtype)
    if weight is None:
        return h
    return tiled_to(as_type(weight, h.dtype).reshape((1,) * (h.ndim - 1) + (hidden,)), h.shape) * h
