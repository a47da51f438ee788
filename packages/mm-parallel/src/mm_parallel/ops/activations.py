"""Activations: gelu (exact or tanh), silu, swiglu."""

from mindspore import ops

from mm_parallel.ops.device import use_fused


def gelu(x, approximate: str = "none"):
    """0.5 x (1 + erf(x / sqrt 2)); with approximate="tanh", 0.5 x (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3)))."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu approximate={approximate!r} is unknown; use 'none' or 'tanh'")
    return ops.gelu(x, approximate=approximate)


def silu(x):
    """x * sigmoid(x)."""
    return ops.silu(x)


def swiglu(gate, up=None):
    """silu(gate) * up. With one tensor, its last dim holds [gate | up] (Megatron's fused layout)."""
    if up is None:
        if gate.shape[-1] % 2:
            raise ValueError(f"swiglu of one tensor needs an even last dim, got {tuple(gate.shape)}")
        if use_fused():
            return ops.swiglu(gate, -1)
        gate, up = ops.chunk(gate, 2, -1)
    return ops.silu(gate) * up
