"""Building blocks every model family shares: linear, RMSNorm, LayerNorm, MLPs, patch embedding.

Names and layouts follow the torch / Hugging Face modules they stand for (``weight`` as
(out_features, in_features), ``gate_proj`` / ``up_proj`` / ``down_proj``), so a checkpoint tensor
maps onto a parameter without renaming. The MLPs are tensor parallel when the topology has
tp > 1 (the first projections split by columns, the last by rows: one all-reduce per MLP), plain
otherwise; an RMSNorm over features that tensor parallelism splits (diffusers' q/k norm "across
heads") sums its squares over the tp group.
"""

from __future__ import annotations

from typing import Optional

import mindspore as ms
from mindspore import nn, ops

from mm_parallel import census, mappings
from mm_parallel import ops as kernels
from mm_parallel.ops.device import as_type, ones, tiled_to
from mm_parallel.ops.norms import in_input_dtype
from mm_parallel.sharding import split
from mm_parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, linear, new_parameter
from mm_parallel.topology import Topology, get_topology

_ACTIVATIONS = {
    "silu": kernels.silu,
    "swish": kernels.silu,
    "gelu": kernels.gelu,
    "gelu_pytorch_tanh": lambda x: kernels.gelu(x, "tanh"),
    "gelu_new": lambda x: kernels.gelu(x, "tanh"),
    "quick_gelu": lambda x: x * ops.sigmoid(x * 1.702),  # OpenAI CLIP's
}


def activation(name: str):
    """The activation function transformers' ACT2FN[name] computes."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; choose one of {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class Linear(nn.Cell):
    """torch.nn.Linear: y = x W^T + b with W (out_features, in_features); replicated on every rank."""

    ZERO3_WEIGHTS = ("weight",)  # multiplied through `linear` (mm_parallel.zero3)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, init_std: Optional[float] = None):
        super().__init__()
        self.weight = new_parameter((out_features, in_features), "weight", init_std, None)
        self.bias = new_parameter((out_features,), "bias", None, None, zeros=True) if bias else None

    def construct(self, x):
        return linear(x, self.weight, self.bias)


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
        self.weight = new_parameter((out_channels, in_channels) + self.kernel, "weight", init_std, None)
        self.bias = new_parameter((out_channels,), "bias", None, None, zeros=True) if bias else None

    def construct(self, patches):
        weight = self.weight.reshape(self.weight.shape[0], -1)
        return linear(patches, weight, self.bias)


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
    """x / sqrt(mean(x^2) + eps) * weight, normalised in float32 (transformers' Qwen2RMSNorm / T5LayerNorm).

    ``split_over_tp=True`` is for a norm over features a column-parallel layer split over tp (the
    norm of all heads' queries at once): each rank holds hidden_size / tp features and its slice
    of the weight, and the mean of squares is taken over all of them,
        mean(x^2) = (1 / hidden_size) sum_r sum(x_r^2)
    The sum over ranks is an all-reduce whose backward is an all-reduce too (every rank's output
    depends on every rank's squares): copy_to_region(reduce_from_region(.)).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, split_over_tp: bool = False,
                 topology: Optional[Topology] = None):
        super().__init__()
        self.eps, self.hidden_size = eps, hidden_size
        self.group = get_topology(topology).tp if split_over_tp else None
        local = hidden_size
        if self.group is not None and self.group.size > 1:
            if hidden_size % self.group.size:
                raise ValueError(f"RMSNorm over {hidden_size} features cannot be split over tp={self.group.size}")
            local = hidden_size // self.group.size
        else:
            self.group = None
        self.weight = census.filled((local,), "weight", 1.0)
        if self.group is not None:
            split(self.weight, (0, "tp"))

    def construct(self, x):
        if self.group is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        dtype, h = x.dtype, as_type(x, ms.float32)
        squares = ops.matmul(ops.square(h), ones((h.shape[-1], 1)))  # local row sums
        squares = mappings.copy_to_region(mappings.reduce_from_region(squares, self.group), self.group)
        h = in_input_dtype(h * tiled_to(ops.rsqrt(squares * (1.0 / self.hidden_size) + self.eps), h.shape), dtype)
        return tiled_to(as_type(self.weight, h.dtype).reshape((1,) * (h.ndim - 1) + (-1,)), h.shape) * h


class LayerNorm(nn.Cell):
    """torch.nn.LayerNorm over the last dim, optionally without affine parameters."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = census.filled((hidden_size,), "weight", 1.0) if elementwise_affine else None
        self.bias = census.filled((hidden_size,), "bias", 0.0) if elementwise_affine and bias else None

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


class _Projection(nn.Cell):
    """diffusers' GELU(dim_in, dim_out) module: ``proj`` then the activation (named net.0.proj)."""

    def __init__(self, proj: nn.Cell, act: str):
        super().__init__()
        self.proj = proj
        self.act = activation(act)

    def construct(self, x):
        return self.act(self.proj(x))


class Identity(nn.Cell):
    """torch's nn.Identity (and nn.Dropout(0)): a placeholder that keeps checkpoint indices."""

    def construct(self, x):
        return x


class Indexed(nn.Cell):
    """torch's nn.ModuleList naming (children "0", "1", ...) for layers a checkpoint indexes, e.g.
    diffusers' ``to_out.0`` and ``net.2``. Children are plain attributes, so a wrapper (LoRA) can
    replace one with setattr; MindSpore's CellList renames parameters on item assignment and
    fails when a child has none."""

    def __init__(self, *cells: nn.Cell):
        super().__init__()
        for index, cell in enumerate(cells):
            self.insert_child_to_cell(str(index), cell)

    def __getitem__(self, index: int) -> nn.Cell:
        return self._cells[str(index)]

    def __len__(self) -> int:
        return len(self._cells)


class FeedForward(nn.Cell):
    """diffusers' FeedForward with a GELU projection: net.2(act(net.0.proj(x))) (net.1 is dropout).

    ``act``: "gelu" or "gelu_pytorch_tanh" (diffusers' "gelu-approximate"). Under tensor
    parallelism net.0.proj is column-parallel and net.2 row-parallel, as GatedMLP; the names match
    diffusers' checkpoints (``ffn.net.0.proj.weight``, ``ffn.net.2.weight``).
    """

    def __init__(self, dim: int, inner_dim: int, dim_out: Optional[int] = None, act: str = "gelu",
                 bias: bool = True, *, topology: Optional[Topology] = None,
                 sequence_parallel: Optional[bool] = None, tensor_parallel: bool = True,
                 init_std: Optional[float] = None):
        super().__init__()
        dim_out = dim if dim_out is None else dim_out
        if tensor_parallel:
            args = dict(topology=get_topology(topology), sequence_parallel=sequence_parallel, init_std=init_std)
            first = ColumnParallelLinear(dim, inner_dim, bias, **args)
            last = RowParallelLinear(inner_dim, dim_out, bias, **args)
        else:
            first, last = Linear(dim, inner_dim, bias, init_std), Linear(inner_dim, dim_out, bias, init_std)
        self.net = Indexed(_Projection(first, act), Identity(), last)

    def construct(self, x):
        return self.net[2](self.net[0](x))
