"""Building blocks every model family shares: linear, RMSNorm, LayerNorm, gated MLP, patch embedding.

Names and layouts follow the torch / Hugging Face modules they stand for (``weight`` as
(out_features, in_features), ``gate_proj`` / ``up_proj`` / ``down_proj``), so a checkpoint tensor
maps onto a parameter without renaming. The gated MLP is tensor parallel when the topology has
tp > 1 (gate / up split by columns, down by rows: one all-reduce per MLP), plain otherwise.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mm_parallel import ops as kernels
from mm_parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, _linear, _param
from mm_parallel.topology import Topology, get_topology

_ACTIVATIONS = {
    "silu": kernels.silu,
    "swish": kernels.silu,
    "gelu": kernels.gelu,
    "gelu_pytorch_tanh": lambda x: kernels.gelu(x, "tanh"),
    "gelu_new": lambda x: kernels.gelu(x, "tanh"),
}


def activation(name: str):
    """The activation function transformers' ACT2FN[name] computes."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; choose one of {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class Linear(nn.Cell):
    """torch.nn.Linear: y = x W^T + b with W (out_features, in_features); replicated on every rank."""

    tp_split_dims: dict = {}

    def __init__(self, in_features: int, out_features: int, bias: bool = True, init_std: Optional[float] = None):
        super().__init__()
        self.weight = _param((out_features, in_features), "weight", init_std, None)
        self.bias = _param((out_features,), "bias", None, None, zeros=True) if bias else None

    def construct(self, x):
        return _linear(x, self.weight, self.bias)


class PatchConv(nn.Cell):
    """torch's Conv2d / Conv3d with stride == kernel (non-overlapping patches), computed as one matmul.

    The weight keeps the conv layout (out_channels, in_channels, *kernel) for checkpoints; the input
    is patches already flattened in (in_channels, *kernel) order, (..., in_channels * prod(kernel)):
        y = patches W.reshape(out_channels, -1)^T + b
    Use `patchify` to cut a (batch, channels, *grid) tensor into such patches.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel, bias: bool = True,
                 init_std: Optional[float] = None):
        super().__init__()
        self.kernel = tuple(kernel)
        self.weight = _param((out_channels, in_channels) + self.kernel, "weight", init_std, None)
        self.bias = _param((out_channels,), "bias", None, None, zeros=True) if bias else None

    def construct(self, patches):
        weight = self.weight.reshape(self.weight.shape[0], -1)
        return _linear(patches, weight, self.bias)


def patchify(x, kernel):
    """(batch, channels, d1, .., dn) -> (batch, d1/k1, .., dn/kn, channels * prod(kernel)) patches in
    (channels, k1, .., kn) order, the input PatchConv expects (a stride == kernel convolution's view)."""
    batch, channels, dims = x.shape[0], x.shape[1], x.shape[2:]
    if len(dims) != len(kernel) or any(d % k for d, k in zip(dims, kernel)):
        raise ValueError(f"input {tuple(x.shape)} cannot be cut into patches of {tuple(kernel)}")
    n = len(kernel)
    split = [batch, channels]
    for d, k in zip(dims, kernel):
        split += [d // k, k]
    x = x.reshape(split)
    order = [0] + [2 + 2 * i for i in range(n)] + [1] + [3 + 2 * i for i in range(n)]
    x = x.transpose(*order)
    return x.reshape((batch,) + tuple(d // k for d, k in zip(dims, kernel)) + (-1,))


class Activation(nn.Cell):
    """An activation as a Cell, for nn.SequentialCell-style containers (torch's nn.GELU() in a list)."""

    def __init__(self, name: str):
        super().__init__()
        self.fn = activation(name)

    def construct(self, x):
        return self.fn(x)


class RMSNorm(nn.Cell):
    """x / sqrt(mean(x^2) + eps) * weight, normalised in float32 (transformers' Qwen2RMSNorm / T5LayerNorm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = Parameter(Tensor(np.ones((hidden_size,), np.float32)), name="weight")

    def construct(self, x):
        return kernels.rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.Cell):
    """torch.nn.LayerNorm over the last dim, optionally without affine parameters."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True):
        super().__init__()
        self.eps = eps
        ones, zeros = np.ones((hidden_size,), np.float32), np.zeros((hidden_size,), np.float32)
        self.weight = Parameter(Tensor(ones), name="weight") if elementwise_affine else None
        self.bias = Parameter(Tensor(zeros), name="bias") if elementwise_affine and bias else None

    def construct(self, x):
        return kernels.layer_norm(x, self.weight, self.bias, self.eps)


class GatedMLP(nn.Cell):
    """down_proj(act(gate_proj(x)) * up_proj(x)) — SwiGLU with act = silu (Llama / Qwen MLP).

    Under tensor parallelism gate / up are column-parallel and down is row-parallel, so the
    intermediate activation stays split on its features and the block costs one all-reduce (or,
    with sequence parallelism, one all-gather in and one reduce-scatter out).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False, *,
                 topology: Optional[Topology] = None, sequence_parallel: Optional[bool] = None,
                 tensor_parallel: bool = True, init_std: Optional[float] = None):
        super().__init__()
        if tensor_parallel:
            args = dict(topology=get_topology(topology), sequence_parallel=sequence_parallel, init_std=init_std)
            self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias, **args)
            self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias, **args)
            self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, **args)
        else:  # replicated (e.g. a small vision tower that every tp rank runs whole)
            self.gate_proj = Linear(hidden_size, intermediate_size, bias, init_std)
            self.up_proj = Linear(hidden_size, intermediate_size, bias, init_std)
            self.down_proj = Linear(intermediate_size, hidden_size, bias, init_std)
        self.act = activation(act)
        self._fused_swiglu = act in ("silu", "swish")

    def construct(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        hidden = kernels.swiglu(gate, up) if self._fused_swiglu else self.act(gate) * up
        return self.down_proj(hidden)
