"""ZeRO-3: weights held as 1/D flat slices, gathered whole only inside the layer that multiplies them.

A sharded weight W (the tp-local tensor, n values) lives as w_r, rank r's slice of flat(W) padded
to a multiple of D, D the size of its gradient-sync group G (dp_cp: data and context parallel
ranks hold replicas of a dense weight; edp: those of an ep rank's experts). Its matmul runs in
a region of its own (the form of mm_parallel.mappings, with the weight as a second input):

    region            forward                              backward (dY given; X the input)
    gathered_matmul   W = unflat(cat_j w_j)                W = unflat(cat_j w_j)          (again)
                      Y = X W^T, W dropped                 dX = dY W
                                                           dw_r = chunk_r(sum_j flat(dY_j^T X_j))
                                                                                  (reduce-scatter)
    gathered_rows     W = unflat(cat_j w_j)                dw_r = chunk_r(sum_j flat(S_j)), S_j the
                      Y = W[ids], W dropped                rows of dY_j added at ids_j (no W needed)
    gathered_experts  W (E, N, K) as above, per expert e:  W again; dX_e = dY_e W_e,
                      Y_e = X_e W_e^T, W dropped           dw_r = chunk_r(sum_j flat(dY_je^T X_je))

Why a region with a written backward: a PyNative bprop receives the inputs (X, w_r), the output
and dY only, so nothing gathered in the forward stays alive until the backward — autograd through
an all-gather would keep every layer's whole W from its forward to its backward, the whole model.
A step therefore holds one layer's whole weight at a time; gathers per step = the sharded weights
x micro-batches x 2 (an embedding's backward needs none; recomputation adds a forward's),
counted in ``GATHERS``. With ``ParallelConfig.reshard_after_forward`` false the first gather of
a step is kept until the optimizer's step (`release`): one gather per weight and step, whole
weights held meanwhile (FSDP's reshard_after_forward=False, ZeRO-2's memory for the weights).
On the device path the next weight's gather is begun while the current layer computes
(mm_parallel.zero3_prefetch), which changes no value; a weight whose next use is its own (the
last layer's backward right after its forward) is kept for it, one gather fewer.

Hybrid sharding (``ParallelConfig.zero3_shard`` "node"): the j above run over the ranks of G
on this rank's node only (G's ``_shard`` group, mm_parallel.topology), which hold the whole
weight between them; the nodes hold replicas. The gathers stay on the node's links, and the
reduce-scattered slice is then summed over the replicas (one all-reduce across nodes, 1/D of
the values): dw_r = sum over nodes of the node's reduce-scatter, G's sum again.

dw_r is the group's sum of this rank's slice; the DistributedOptimizer (zero_stage 3) divides it
by dp like every gradient and updates w_r where it lies: no all-gather after the step. Checkpoints
keep today's format (mm_parallel.sharding: ``flat_over`` gathers and re-cuts the slices), so a
ZeRO-3 run resumes under ZeRO-1 or another dp, and the reverse.

Which weights (`shard_parameters`): those a cell lists in ``ZERO3_WEIGHTS`` and uses through a
region (``ZERO3_REGION``: "matmul" for column / row parallel and replicated linears, which
multiply through `linear`; "rows" for the vocabulary embedding; "experts" for MoE experts' fused
tensors, cut over expert-dp — the group their gradients sync over) of at least ``min_numel`` values,
not tied to another cell, trained or frozen (a LoRA base, a frozen tower: held as slices too, its
backward computing dX alone; frozen as it is when cut). The slice is float32 whatever the layer
computes in (FSDP2's sharded parameter: the optimizer's update lands there unrounded; the region
rounds W to the layer's dtype, as the optimizer's write of a whole bf16 weight would), and each
rank's dW is rounded to that dtype before the float32 sum: the values of the whole weight's path.
The rest (norms, biases, convolutions, tied weights) stays whole and is reduced as under
ZeRO-2; `Sharded` counts both.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import weakref
from dataclasses import dataclass
from typing import Optional

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mm_parallel import comm
from mm_parallel.census import owned_parameters
from mm_parallel.ops import low_precision
from mm_parallel.ops.device import as_type, use_fused
from mm_parallel.ops.grouped_matmul import grouped_matmul, padded_slots
from mm_parallel.ops.low_precision import compute_weight
from mm_parallel.sharding import set_sharding, sharding_of
from mm_parallel.topology import Topology, get_topology
from mm_parallel.zero3_prefetch import PREFETCH

GATHERS: collections.Counter = collections.Counter()  # "forward" / "backward": whole weights gathered

_matmul_nt = ops.MatMul(transpose_b=True)
_matmul_tn = ops.MatMul(transpose_a=True)
_bmm, _bmm_nt, _bmm_tn = ops.BatchMatMul(), ops.BatchMatMul(transpose_b=True), ops.BatchMatMul(transpose_a=True)


@dataclass(frozen=True)
class Sharded:
    """What `shard_parameters` did: weights (and their values) sharded, and those left whole."""

    sharded: int
    sharded_numel: int
    whole: int
    whole_numel: int


class _GatheredMatmul(nn.Cell):
    """The region of the module docstring for one sharded weight, computing in ``dtype``."""

    def __init__(self, spec, topology: Topology, dtype, trains: bool = True):
        super().__init__()
        self.spec, self.topology, self.dtype, self.trains = spec, topology, dtype, trains
        self.kept = None  # the gathered weight, kept for the step without reshard_after_forward
        self.shard = None  # a weak reference to the slice (set by shard_parameters)
        self.group = spec.flat_group(topology)
        self.replicas = topology.zero3_replicas(spec.flat_over)  # hybrid sharding: one per node
        self.numel = int(np.prod(spec.local_shape))

    def whole(self, shard, phase: str):
        """W as the matmul takes it: rounded (or cast) to the compute dtype before the gather,
        which halves a bf16 gather's bytes on a device and changes no value. Without
        reshard_after_forward the first gather of a step is kept until `release` (the weights
        change only at the optimizer step)."""
        if self.kept is not None:
            return self.kept
        weight = PREFETCH.take(self)  # begun while the layer before computed (mm_parallel.zero3_prefetch)
        if weight is None:
            weight = self.begin(phase, shard).wait()
        if not self.topology.config.reshard_after_forward:
            self.kept = weight
            _KEEPING.append(self)
        PREFETCH.used(self, phase, weight)
        return weight

    def begin(self, phase: str, shard=None):
        """The gather of W begun (a `comm.Pending`; asynchronous on the device path), counted."""
        GATHERS[phase] += 1
        shard = self.shard() if shard is None else shard
        gathering = self.spec.unflatten_start(low_precision.to_compute(shard, self.dtype), self.topology)
        return comm.Pending(lambda: compute_weight(gathering.wait()))

    def construct(self, x, shard):
        return _matmul_nt(x, self.whole(shard, "forward"))

    def bprop(self, x, shard, out, dout):
        weight = self.whole(shard, "backward")
        dx = ops.matmul(dout, weight)
        if not self.trains:  # a frozen weight (a LoRA base, a frozen tower): dX only, no dW to reduce
            return dx, ops.zeros_like(shard)
        return dx, self._reduce_scattered(_matmul_tn(dout, x))

    def _reduce_scattered(self, dw):
        """This rank's slice of the group's sum of dW, each rank's dW first rounded to the layer's
        dtype (as autograd returns a whole bf16 weight's gradient), summed in float32."""
        flat = as_type(low_precision.to_compute(dw, self.dtype), ms.float32).reshape(-1)
        padded = self.group.size * -(-self.numel // self.group.size)
        if padded > self.numel:
            flat = ops.concat([flat, ops.zeros(padded - self.numel, flat.dtype)])
        mine = comm.reduce_scatter(flat, self.group)
        return comm.all_reduce(mine, self.replicas) if self.replicas.size > 1 else mine


class _GatheredRows(_GatheredMatmul):
    """The embedding's region: rows = W[ids] from the gathered table; its backward needs no W:
    dW = the rows' gradients added at their ids (rounded to the layer's dtype on each rank, as a
    whole bf16 table's gradient is), reduce-scattered into the slice."""

    def construct(self, ids, shard):
        return ops.gather(self.whole(shard, "forward"), ids, 0)

    def bprop(self, ids, shard, out, dout):
        if not self.trains:
            return ops.zeros_like(ids), ops.zeros_like(shard)
        rows, width = self.spec.local_shape[0], dout.shape[-1]
        table = ops.unsorted_segment_sum(as_type(dout, ms.float32).reshape(-1, width), ids.reshape(-1), rows)
        return ops.zeros_like(ids), self._reduce_scattered(table)


class _GatheredExperts(_GatheredMatmul):
    """The experts' region: Y_e = X_e W_e^T for each local expert e of the gathered (E, N, K)
    tensor. X is the (E, M, K) block of each expert's rows padded to M (CPU: two batched
    matmuls), or, on the device path, the rows grouped by expert, ``counts`` of each (Ascend's
    grouped_matmul). Backward: W gathered again, dX_e = dY_e W_e the same way, dW_e = dY_e^T X_e
    over each expert's rows (padded blocks either way: one batched matmul) reduce-scattered."""

    def construct(self, x, shard, counts):
        weight = self.whole(shard, "forward")
        return grouped_matmul(x, weight, counts.asnumpy()) if use_fused() else _bmm_nt(x, weight)

    def bprop(self, x, shard, counts, out, dout):
        weight = self.whole(shard, "backward")
        if use_fused():
            sizes = counts.asnumpy()
            dx = grouped_matmul(dout, ops.transpose(weight, (0, 2, 1)), sizes)
            x, dout = _blocks(x, sizes), _blocks(dout, sizes)
        else:
            dx = _bmm(dout, weight)
        if not self.trains:
            return dx, ops.zeros_like(shard), ops.zeros_like(counts)
        return dx, self._reduce_scattered(_bmm_tn(dout, x)), ops.zeros_like(counts)


def _blocks(rows, counts):
    """(E, max(counts), width): expert e's ``counts[e]`` consecutive rows, padded with zeros."""
    slots = padded_slots(counts, max(int(counts.max(initial=0)), 1))
    padded = ops.concat([rows, ops.zeros((1, rows.shape[1]), rows.dtype)])
    return ops.gather(padded, Tensor(slots.reshape(-1).astype(np.int32)), 0).reshape(
        slots.shape + (rows.shape[1],))


# a cell's ZERO3_REGION names its weight's
REGIONS = {"matmul": _GatheredMatmul, "rows": _GatheredRows, "experts": _GatheredExperts}


_KEEPING: list = []  # the regions holding a kept weight (reshard_after_forward false)


def release() -> None:
    """Drop the whole weights kept since the last step and the gathers begun ahead (the optimizer
    calls it: its update changes the weights)."""
    PREFETCH.step_done()
    while _KEEPING:
        _KEEPING.pop().kept = None


def gathered_rows(ids, weight):
    """W[ids] for an embedding table `shard_parameters` cut (`_GatheredRows`)."""
    return weight.zero3_region(ids, weight)


def gathered_experts(x, weight, counts):
    """Each expert's rows times its W_e^T for experts `shard_parameters` cut (`_GatheredExperts`):
    ``x`` the (E, M, K) padded block, or the grouped rows on the device path (``counts`` a numpy
    array of each expert's rows)."""
    return weight.zero3_region(x, weight, Tensor(np.asarray(counts, np.int64)))


def is_sharded(weight) -> bool:
    return sharding_of(weight).flat_over is not None


def compute_dtype(weight):
    """The dtype a ZeRO-3 weight's layer computes in (its slice is float32)."""
    return weight.zero3_region.dtype


def value_dtype(param):
    """The dtype of a parameter's values as a checkpoint keeps them: a ZeRO-3 slice's layer's."""
    return compute_dtype(param) if is_sharded(param) else param.dtype


def value_shape(param) -> tuple:
    """The shape of a parameter's values on this rank: a ZeRO-3 slice's tp-local tensor's."""
    return tuple(sharding_of(param).local_shape or param.shape)


def output_features(weight) -> int:
    """A linear weight's rows (out_features), whole or ZeRO-3's flat slice."""
    return value_shape(weight)[0]


def gathered_matmul(x2d, weight):
    """x2d W^T for a weight `shard_parameters` cut (the region of the module docstring)."""
    region = getattr(weight, "zero3_region", None)
    if region is None:
        raise ValueError(f"{weight.name} is not a ZeRO-3 weight (mm_parallel.zero3.shard_parameters makes them)")
    return region(x2d, weight)


def sharded_weights(model: nn.Cell, topology=None, min_numel: Optional[int] = None):
    """(cell, attribute, parameter) of every weight `shard_parameters` cuts (module docstring):
    by shapes and flags alone, so that `mm-train plan` counts them on a shape-only build."""
    topo = get_topology(topology if topology is not None else getattr(model, "topology", None))
    min_numel = topo.config.zero3_min_numel if min_numel is None else min_numel
    owners = collections.Counter(id(p) for _, cell in model.cells_and_names() for p in cell._params.values())
    chosen = []
    for _, param, cell, attr in owned_parameters(model):
        spec = sharding_of(param)
        # a tied weight (an LM head sharing the embedding's) is read whole by its other owner: kept whole
        if (attr in getattr(cell, "ZERO3_WEIGHTS", ()) and math.prod(param.shape) >= min_numel
                and owners[id(param)] == 1 and spec.flat_over is None
                and topo.zero3_shard(spec.grad_sync).size > 1):
            chosen.append((cell, attr, param))
    return chosen


def shard_parameters(model: nn.Cell, topology=None, min_numel: Optional[int] = None) -> Sharded:
    """Cut every eligible weight of ``model`` (`sharded_weights`) into this rank's flat slice, in
    place; ``min_numel``: by default the topology's ParallelConfig.zero3_min_numel (smaller
    weights' gathers would cost more than they save)."""
    topo = get_topology(topology if topology is not None else getattr(model, "topology", None))
    chosen = sharded_weights(model, topo, min_numel)
    sharded_numel = 0
    for cell, attr, param in chosen:
        spec, numel = sharding_of(param), math.prod(param.shape)
        flat_spec = dataclasses.replace(spec, flat_over=spec.grad_sync, local_shape=tuple(int(d) for d in param.shape))
        value = flat_spec.flat_slice(as_type(param, ms.float32).asnumpy(), topo)
        # the slice in float32 whatever the layer computes in (FSDP2's sharded parameter): the
        # optimizer writes its fp32 update there, the region rounds it for the matmul
        shard = Parameter(Tensor(value, ms.float32), name=param.name, requires_grad=param.requires_grad)
        set_sharding(shard, flat_spec)
        shard.zero3_region = REGIONS[getattr(cell, "ZERO3_REGION", "matmul")](flat_spec, topo, param.dtype,
                                                                             param.requires_grad)
        # a weak reference (a Parameter attribute would make the region own the slice): its
        # prefetched gather reads the slice (mm_parallel.zero3_prefetch)
        shard.zero3_region.shard = weakref.ref(shard)
        setattr(cell, attr, shard)
        sharded_numel += numel
    if chosen:
        _refresh_recomputed(model)
    trained = [p for p in model.trainable_params() if sharding_of(p).flat_over is None]
    return Sharded(len(chosen), sharded_numel, len(trained), sum(math.prod(p.shape) for p in trained))


def _refresh_recomputed(model: nn.Cell) -> None:
    """Mark the recomputed cells again: MindSpore's ``Cell.recompute()`` captures the cell's
    trainable parameters when it is called (its recompute cell's ``internal_params``), which
    would still name the whole weights the slices replaced — their slices would get no gradient."""
    for _, cell in model.cells_and_names():
        if getattr(cell, "_recompute_cell", None) is not None:
            cell.recompute()
