"""Tensor-parallel layers (Megatron's column / row / vocabulary split) and weight sharding helpers.

Weights keep the torch ``nn.Linear`` layout (out_features, in_features) and the names ``weight`` /
``bias``, so a Hugging Face tensor maps onto a shard by one slice. Each layer declares its
parameters' sharding (mm_parallel.sharding: which dim is split over tp; absent: replicated).

    ColumnParallelLinear   A split by output rows:  Y_r = X A_r^T + b_r        (Y gathered if asked)
    RowParallelLinear      A split by input cols:   Y = sum_r X_r A_r^T + b     (X split if not yet)
    VocabParallelEmbedding E split by vocabulary:   Y = sum_r [id in V_r] E_r[id - start_r]

With ``sequence_parallel`` the activations outside the layers are split along the sequence
(dim ``seq_dim``) over the tp group: a column layer all-gathers the sequence on the way in
(its backward reduce-scatters), a row layer and the embedding reduce-scatter on the way out.
"""

from __future__ import annotations

import itertools
from typing import Optional

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mm_parallel import census, comm, mappings, zero3
from mm_parallel.ops import low_precision
from mm_parallel.ops.device import as_type, host_array, ones, tiled_to, use_fused
from mm_parallel.sequence_parallel import mark_sequence_parallel
from mm_parallel.sharding import sharding_of, split
from mm_parallel.topology import Group, Topology, get_topology

_matmul_nt = ops.MatMul(transpose_b=True)


def sharded_shape(full_shape, group: Group, dim: int) -> tuple:
    """``full_shape`` with ``dim`` cut to one rank's equal part (the shape `shard` returns)."""
    shape = tuple(int(d) for d in full_shape)
    length = shape[dim]
    if length % group.size:
        raise ValueError(
            f"cannot shard a dim of length {length} (shape {shape}, dim {dim}) over {group.size} "
            f"tensor-parallel ranks; it must be a multiple of {group.size}"
        )
    dim %= len(shape)
    return shape[:dim] + (length // group.size,) + shape[dim + 1:]


def shard(full, group: Group, dim: int):
    """This rank's equal slice of ``full`` (numpy array or Tensor) along ``dim``."""
    size = sharded_shape(full.shape, group, dim)[dim]
    index = [slice(None)] * len(full.shape)
    index[dim] = slice(group.rank * size, (group.rank + 1) * size)
    return full[tuple(index)]


def unshard(local, group: Group, dim: int):
    """The full tensor from every rank's slice along ``dim`` (an all-gather)."""
    return comm.all_gather(local, group, dim)


class _BiasAdd(nn.Cell):
    """out + bias over the rows of a 2-D out, with the bias gradient as ones (1, rows) @ dout.
    On CPU the broadcasting add took 34 ms on 2048 x 2048 and its gradient (a row reduction)
    70-90 ms; BiasAdd and the matmul take 4 ms and 1.3 ms."""

    def construct(self, out, bias):
        return ops.bias_add(out, bias)

    def bprop(self, out, bias, result, dout):
        return dout, ops.matmul(ones((1, dout.shape[0]), dout.dtype), dout).reshape(bias.shape)


_bias_add = _BiasAdd()


def linear(x, weight, bias):
    """x W^T + b computed in W's dtype (mm_parallel.ops.low_precision: emulated on CPU for bf16 / fp16);
    a ZeRO-3 weight is gathered for the matmul alone (mm_parallel.zero3)."""
    if zero3.is_sharded(weight):
        dtype = zero3.compute_dtype(weight)
        x = low_precision.to_compute(x, dtype)
        out = zero3.gathered_matmul(x.reshape(-1, x.shape[-1]), weight)
    else:
        dtype = weight.dtype
        x, w = low_precision.matmul_operands(x, weight)
        out = _matmul_nt(x.reshape(-1, x.shape[-1]), w)
    if bias is not None:
        out = _bias_add(out, as_type(bias, out.dtype))
    if dtype in low_precision.LOW:
        out = low_precision.to_compute(out, dtype)
    return out.reshape(x.shape[:-1] + (zero3.output_features(weight),))


def add_bias(y, bias):
    """y + bias over the last dim, through `_BiasAdd` (a broadcasting add is ~10x slower on CPU)."""
    return _bias_add(y.reshape(-1, y.shape[-1]), as_type(bias, y.dtype)).reshape(y.shape)


_init_count = itertools.count()


def init_rng() -> np.random.Generator:
    """The generator the next parameter is initialised from, the same on every rank.

    Seeded by MindSpore's global seed (``mindspore.set_seed``; 0 if unset) and how many parameters
    this process initialised before: ranks that build the same model draw the same numbers, so a
    replicated parameter is equal everywhere and a sharded one is a slice of the tensor a single
    process would draw (the model starts identical under any tp).
    """
    seed = ms.get_seed()
    return np.random.default_rng([0 if seed is None else seed, next(_init_count)])


def seed_parameters(seed: int) -> None:
    """Start parameter initialisation afresh: MindSpore's global seed set and the count of
    parameters drawn so far reset, so the next model is drawn as in a fresh process whatever
    this process built before (encoders, other models)."""
    global _init_count
    ms.set_seed(seed)
    _init_count = itertools.count()


def new_parameter(full_shape, name, init_std: Optional[float], group: Group, split_dim: Optional[int] = None,
                  zeros: bool = False):
    """A parameter drawn whole (normal(0, init_std or 0.02), or zeros) and cut to this rank's shard
    of ``group`` (declared split over tp along ``split_dim``, see mm_parallel.sharding)."""
    full_shape = tuple(full_shape)
    local_shape = sharded_shape(full_shape, group, split_dim) if split_dim is not None else full_shape

    def value():
        if zeros:
            whole = np.zeros(full_shape, np.float32)
        else:
            whole = init_rng().normal(0.0, init_std or 0.02, full_shape).astype(np.float32)
        return shard(whole, group, split_dim) if split_dim is not None else whole

    param = census.parameter(local_shape, name, value)
    return split(param, (split_dim, "tp")) if split_dim is not None else param


class _TensorParallel(nn.Cell):
    """Shared bookkeeping: the tp group and the sequence-parallel flag."""

    def __init__(self, topology: Optional[Topology], sequence_parallel: Optional[bool], seq_dim: int):
        super().__init__()
        topology = get_topology(topology)
        self.group = topology.tp
        self.sequence_parallel = topology.config.sequence_parallel if sequence_parallel is None else sequence_parallel
        self.seq_dim = seq_dim

    def load_full(self, **full):
        """Set parameters from full (unsharded) arrays, e.g. load_full(weight=W, bias=b)."""
        for name, value in full.items():
            param = getattr(self, name)
            dim = sharding_of(param).dim("tp")
            value = host_array(value, np.float32)
            local = value if dim is None else shard(value, self.group, dim)
            if tuple(local.shape) != tuple(param.shape):
                raise ValueError(f"{name}: full shape {value.shape} gives shard {local.shape}, "
                                 f"expected {tuple(param.shape)}")
            param.set_data(Tensor(np.ascontiguousarray(local)))


class ColumnParallelLinear(_TensorParallel):
    """Linear whose output features are split over tp; see the module docstring."""

    ZERO3_WEIGHTS = ("weight",)  # multiplied through `linear` (mm_parallel.zero3)

    def __init__(self, in_features, out_features, bias=True, gather_output=False, *, topology=None,
                 sequence_parallel=None, seq_dim=1, init_std=None):
        super().__init__(topology, sequence_parallel, seq_dim)
        if out_features % self.group.size:
            raise ValueError(f"out_features={out_features} must be divisible by tp={self.group.size}")
        self.gather_output = gather_output
        self.weight = new_parameter((out_features, in_features), "weight", init_std, self.group, 0)
        self.bias = new_parameter((out_features,), "bias", None, self.group, 0, zeros=True) if bias else None

    def construct(self, x):
        if self.sequence_parallel:
            x = mappings.gather_from_sequence(x, self.group, self.seq_dim)
        else:
            x = mappings.copy_to_region(x, self.group)
        y = linear(x, self.weight, self.bias)
        return mappings.gather_from_region(y, self.group, -1) if self.gather_output else y


class RowParallelLinear(_TensorParallel):
    """Linear whose input features are split over tp; see the module docstring."""

    ZERO3_WEIGHTS = ("weight",)

    def __init__(self, in_features, out_features, bias=True, input_is_parallel=True, *, topology=None,
                 sequence_parallel=None, seq_dim=1, init_std=None):
        super().__init__(topology, sequence_parallel, seq_dim)
        if in_features % self.group.size:
            raise ValueError(f"in_features={in_features} must be divisible by tp={self.group.size}")
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel needs input_is_parallel=True (the input is split on features)")
        self.input_is_parallel = input_is_parallel
        self.weight = new_parameter((out_features, in_features), "weight", init_std, self.group, 1)
        self.bias = new_parameter((out_features,), "bias", None, self.group, zeros=True) if bias else None
        if self.bias is not None and self.sequence_parallel:
            mark_sequence_parallel(self.bias)  # added on a sequence shard: its grad is partial over tp

    def construct(self, x):
        if not self.input_is_parallel:
            x = mappings.scatter_to_region(x, self.group, -1)
        y = linear(x, self.weight, None)
        if self.sequence_parallel:
            y = mappings.reduce_scatter_to_sequence(y, self.group, self.seq_dim)
        else:
            y = mappings.reduce_from_region(y, self.group)
        return y if self.bias is None else add_bias(y, self.bias)


class VocabParallelEmbedding(_TensorParallel):
    """Embedding whose vocabulary rows are split over tp; see the module docstring."""

    ZERO3_WEIGHTS, ZERO3_REGION = ("weight",), "rows"  # looked up through `_rows` (mm_parallel.zero3)

    def __init__(self, num_embeddings, embedding_dim, *, topology=None, sequence_parallel=None, seq_dim=1,
                 init_std=None):
        super().__init__(topology, sequence_parallel, seq_dim)
        if num_embeddings % self.group.size:
            raise ValueError(
                f"vocabulary size {num_embeddings} must be divisible by tp={self.group.size}; pad the vocabulary"
            )
        self.num_embeddings = num_embeddings
        self.per_rank = num_embeddings // self.group.size
        self.start = self.group.rank * self.per_rank
        self.weight = new_parameter((num_embeddings, embedding_dim), "weight", init_std, self.group, 0)

    def construct(self, input_ids):
        if self.group.size == 1:
            return self._rows(input_ids)
        local = input_ids - self.start
        outside = ops.logical_or(local < 0, local >= self.per_rank)
        rows = self._rows(ops.masked_fill(local, outside, 0))
        rows = ops.masked_fill(rows, outside[..., None], 0.0)
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence(rows, self.group, self.seq_dim)
        return mappings.reduce_from_region(rows, self.group)

    def _rows(self, ids):
        """This rank's table rows at ``ids`` (float32 when emulating: no bf16 gather on CPU)."""
        if zero3.is_sharded(self.weight):
            return zero3.gathered_rows(ids, self.weight)
        return ops.gather(low_precision.compute_weight(self.weight), ids, 0)


def vocab_parallel_cross_entropy(logits, labels, group: Optional[Group] = None, ignore_index: int = -100,
                                 reduction: str = "mean"):
    """Cross entropy of logits split on the vocabulary (last dim) over ``group``.

    Equals full-vocabulary cross entropy: with m = max over all ranks (no gradient; it cancels),
    loss = log sum_r sum_v exp(l_v - m) - (l_label - m), the two sums reduced over tp.
    Tokens labelled ``ignore_index`` count for nothing; "mean" divides by the counted tokens.
    On the device path (fused kernels) everything stays on the device, the whole vocabulary too:
    no label is read back to the host.
    """
    group = get_topology().tp if group is None else group
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} is unknown; use 'mean', 'sum' or 'none'")
    if group.size == 1 and reduction != "none" and not use_fused():  # the CPU's host shortcut (measured)
        return _cross_entropy_whole_vocabulary(logits, labels, ignore_index, reduction)
    per_rank = logits.shape[-1]
    start = group.rank * per_rank
    logits = as_type(logits, ms.float32)
    # ops.amax, not Tensor.max: that one makes a host tensor and reads one back per call (measured)
    row_max = ops.stop_gradient(comm.all_reduce(ops.amax(logits, -1, True), group, "max"))
    shifted = logits - tiled_to(row_max, logits.shape)
    local = labels - start
    outside = ops.logical_or(local < 0, local >= per_rank)
    picked = ops.gather_elements(shifted, -1, ops.masked_fill(local, outside, 0)[..., None]).squeeze(-1)
    picked = mappings.reduce_from_region(ops.masked_fill(picked, outside, 0.0), group)
    # a row sum as a matmul: 5x faster than sum(-1) on CPU
    total = ops.matmul(ops.exp(shifted).reshape(-1, per_rank), ones((per_rank, 1))).reshape(labels.shape)
    loss = ops.log(mappings.reduce_from_region(total, group)) - picked
    valid = labels != ignore_index
    loss = ops.masked_fill(loss, ops.logical_not(valid), 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / ops.maximum(valid.astype(ms.float32).sum(), 1.0)


_sparse_cross_entropy = ops.SparseSoftmaxCrossEntropyWithLogits()


def _cross_entropy_whole_vocabulary(logits, labels, ignore_index: int, reduction: str):
    """One rank holds the whole vocabulary: the counted rows (found on the host) go through
    MindSpore's fused sparse softmax cross entropy, ~10x faster on CPU than the composed path."""
    vocab = logits.shape[-1]
    host_labels = host_array(labels).reshape(-1)
    keep = np.nonzero(host_labels != ignore_index)[0]
    if not len(keep):
        return logits.reshape(-1)[:1].astype(ms.float32).sum() * 0.0
    rows = ops.gather(as_type(logits.reshape(-1, vocab), ms.float32), Tensor(keep.astype(np.int32)), 0)
    mean = _sparse_cross_entropy(rows, Tensor(host_labels[keep].astype(np.int32)))
    return mean if reduction == "mean" else mean * float(len(keep))
