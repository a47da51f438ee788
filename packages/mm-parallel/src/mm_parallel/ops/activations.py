"""Activations: gelu (exact or tanh), silu, swiglu."""

import math

import mindspore as ms
from mindspore import nn, ops

from mm_parallel.ops import native
from mm_parallel.ops.device import use_fused

_TANH_SCALE = 2.0 * math.sqrt(2.0 / math.pi)  # 0.5 (1 + tanh(z)) = sigmoid(2 z)
_CUBIC = 0.044715


class _GeluTanh(nn.Cell):
    """gelu with the tanh approximation written as x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)),
    the same function, with its derivative written out:
        d/dx = s + x s (1 - s) 2 sqrt(2/pi) (1 + 3 * 0.044715 x^2),   s = sigmoid(...)
    MindSpore's CPU GeLU kernel took 132 ms forward / 280 ms backward on 2048 x 2048; this takes
    18 / ~30 ms (same-shape elementwise ops only)."""

    def construct(self, x):
        square = x * x
        return x * ops.sigmoid((x + x * square * _CUBIC) * _TANH_SCALE)

    def bprop(self, x, out, dout):
        square = x * x
        s = ops.sigmoid((x + x * square * _CUBIC) * _TANH_SCALE)
        slope = (square * (3.0 * _CUBIC) + 1.0) * _TANH_SCALE
        return (dout * (s + x * (s - s * s) * slope),)


_gelu_tanh = _GeluTanh()


class _NativeGeluTanh(nn.Cell):
    """`_GeluTanh` with each direction one fused C++ pass (mm_parallel.ops.native, gelu_tanh.cc):
    on 2048 x 2048, 8.4 -> 1.8 ms forward, 34 -> 7.6 ms forward + backward."""

    def __init__(self, forward, backward):
        super().__init__()
        self.forward, self.backward = forward, backward

    def construct(self, x):
        return self.forward(x)

    def bprop(self, x, out, dout):
        return (self.backward(x, dout),)


def _gelu_tanh_on_cpu():
    """The native gelu-tanh Cell when its kernels build, else the written-out one."""
    forward, backward = native.operator("gelu_tanh", "GeluTanh"), native.operator("gelu_tanh", "GeluTanhBackward")
    return _GeluTanh() if forward is None or backward is None else _NativeGeluTanh(forward, backward)


def gelu(x, approximate: str = "none"):
    """0.5 x (1 + erf(x / sqrt 2)); with approximate="tanh", 0.5 x (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3)))."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu approximate={approximate!r} is unknown; use 'none' or 'tanh'")
    if approximate == "tanh" and not use_fused():
        fused = native.cell("gelu_tanh", _gelu_tanh_on_cpu) if x.dtype == ms.float32 else None
        return (fused or _gelu_tanh)(x)
    return ops.gelu(x, approximate=approximate)


class _NativeSwiglu(nn.Cell):
    """silu(gate) up with each direction one fused C++ pass (mm_parallel.ops.native, swiglu.cc):
    on 2048 x 2048, 4.3 -> 2.2 ms forward, 18 -> 7 ms forward + backward (MindSpore's SiLU and
    its gradient kernel, then the product)."""

    def __init__(self):
        super().__init__()
        self.forward = native.operator("swiglu", "Swiglu")
        self.backward = native.operator("swiglu", "SwigluBackward", "two_like_first")

    def construct(self, gate, up):
        return self.forward(gate, up)

    def bprop(self, gate, up, out, dout):
        return self.backward(gate, up, dout)


def _native_swiglu():
    """The native swiglu Cell, or None when its kernels do not build."""
    available = native.operator("swiglu", "Swiglu") and native.operator("swiglu", "SwigluBackward", "two_like_first")
    return _NativeSwiglu() if available else None


def _swiglu_on_cpu(gate, up):
    """silu(gate) up on the CPU path: native when its kernels build (float32 operands of one shape)."""
    same = gate.dtype == up.dtype == ms.float32 and tuple(gate.shape) == tuple(up.shape)
    fused = native.cell("swiglu", _native_swiglu) if same else None
    return ops.silu(gate) * up if fused is None else fused(gate, up)


def silu(x):
    """x * sigmoid(x)."""
    return ops.silu(x)


def swiglu(gate, up=None):
    """silu(gate) * up. With one tensor, its last dim holds [gate | up] (Megatron's fused layout).

    On Ascend the fused swiglu kernel computes it; given gate and up apart (two column-parallel
    projections) they are joined along the last dim for it (one copy of the activation)."""
    if up is None:
        if gate.shape[-1] % 2:
            raise ValueError(f"swiglu of one tensor needs an even last dim, got {tuple(gate.shape)}")
        if use_fused():
            return ops.swiglu(gate, -1)
        gate, up = ops.chunk(gate, 2, -1)
    elif use_fused():
        return ops.swiglu(ops.concat([gate, up], -1), -1)
    return _swiglu_on_cpu(gate, up)
