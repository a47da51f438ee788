"""The DistributedOptimizer's buckets: the trainable parameters reduced over one group, laid end
to end and cut into buckets of at most ``bucket_numel`` values, each with flat fp32 buffers.

A group's N values are cut every C values, C = ``bucket_numel`` rounded up to a multiple of D
(the group's size under ZeRO, else 1); a parameter that crosses a cut is split between two
buckets (a `Piece` each). Only the last bucket is padded, to a multiple of D. Each rank keeps
master weights and moments for its slice [r C / D, (r + 1) C / D) of every bucket.

Why bounded buckets: a step's transient buffers are those of one bucket at a time. Reducing a
bucket holds its flat gradient and the reduced copy (2 x 4 C bytes), gathering the updated
weights the gathered flat (and on CPU its D parts). With one bucket per group they were whole-model
sized: measured on 50M parameters (VmHWM above the step's start, in units of 4 N bytes) dp 2
without ZeRO 1.00, with ZeRO-1 1.06 to 1.50 — a slice of the reduced flat kept its whole buffer
alive. Megatron-Core's DDP cuts its gradient buffer into buckets of 40M values by default too.
(Its buckets end at parameter boundaries; ours cut through a large parameter, so that an
embedding or an LM head of 500M values is bounded as well.)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, ops

from mm_parallel import comm, zero3
from mm_parallel.ops.device import as_type, use_fused
from mm_parallel.sharding import sharding_of
from mm_parallel.topology import Group

_fused_adam = ops.AdamWeightDecay()
STATES = ("master", "exp_avg", "exp_avg_sq")
DEFAULT_BUCKET_NUMEL = 40_000_000  # Megatron-Core's DistributedDataParallelConfig default
ZERO3_GROUP = "zero3"  # the buckets of ZeRO-3 slices (mm_parallel.zero3)


@dataclass(frozen=True)
class Piece:
    """Values [lo, hi) of trainable parameter ``param`` (its flat view of ``numel`` values), held
    by one bucket."""

    param: int
    lo: int
    hi: int
    numel: int

    @property
    def size(self) -> int:
        return self.hi - self.lo

    @property
    def is_whole(self) -> bool:
        """The whole parameter (not cut between buckets)."""
        return self.size == self.numel


def cut_into_buckets(params: Sequence[int], sizes: Sequence[int], bucket_numel: int, shards: int) -> List[List[Piece]]:
    """The pieces of each bucket: parameters ``params`` (of ``sizes`` values) end to end, cut
    every C values, C = ``bucket_numel`` rounded up to a multiple of ``shards`` (0: no cut)."""
    total = int(sum(sizes))
    capacity = total if bucket_numel <= 0 else -(-bucket_numel // shards) * shards
    buckets: List[List[Piece]] = []
    current: List[Piece] = []
    room = capacity
    for param, size in zip(params, sizes):
        lo = 0
        while lo < size:
            take = min(size - lo, room)
            current.append(Piece(param, lo, lo + take, size))
            lo, room = lo + take, room - take
            if room == 0:
                buckets.append(current)
                current, room = [], capacity
    if current:
        buckets.append(current)
    return buckets


def zero_shards(group, zero_stage: int) -> int:
    """D: the slices each bucket of ``group`` is cut into (the group's size under ZeRO, else 1)."""
    return group.size if zero_stage > 0 else 1


def bucket_slice(numel: int, group, zero_stage: int) -> Tuple[int, int, int, int]:
    """(shards, padded, start, end) of a bucket of ``numel`` values reduced over ``group``: padded
    to a multiple of the D shards (`zero_shards`) and the [start, end) slice this rank keeps
    master weights and moments for."""
    shards = zero_shards(group, zero_stage)
    padded = -(-numel // shards) * shards
    per_shard = padded // shards
    index = group.rank if zero_stage > 0 else 0
    return shards, padded, index * per_shard, (index + 1) * per_shard


def no_weight_decay(name: str, param) -> bool:
    """Biases and 1-D parameters (norm weights) are not decayed (Megatron's rule); a ZeRO-3 slice
    by the shape of its whole tensor."""
    return name.endswith("bias") or len(zero3.value_shape(param)) <= 1


class WholeParameters:
    """Whole parameter values from the pieces of consecutive buckets: a parameter cut between
    buckets is complete at its last piece (``concat`` joins the parts: numpy or MindSpore)."""

    def __init__(self, concat: Callable):
        self.concat, self.parts = concat, {}

    def add(self, piece: Piece, value):
        """The parameter's whole flat value once ``piece`` completes it, else None."""
        if piece.is_whole:
            return value
        self.parts.setdefault(piece.param, []).append(value)
        if piece.hi < piece.numel:
            return None
        return self.concat(self.parts.pop(piece.param))


class Bucket:
    """One bucket's pieces of ``params`` (the optimizer's trainable parameters), its group and
    flat fp32 buffers of this rank's slice: master weights, exp_avg, exp_avg_sq."""

    def __init__(self, params: Sequence, pieces: List[Piece], group, zero_stage: int, topo, tag: str,
                 offload: bool = False):
        self.params, self.pieces, self.group, self.zero_stage, self.tag = params, pieces, group, zero_stage, tag
        self.sizes = [piece.size for piece in pieces]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.numel = int(self.offsets[-1])
        self.shards, self.padded, self.start, self.end = bucket_slice(self.numel, group, zero_stage)
        # padding values are zeros: counting them adds nothing, and keeps the common case "count all"
        decay, counted = np.zeros(self.padded, np.float32), np.zeros(self.padded, bool)
        holder = self.shards > 1 or group.rank == 0  # a replicated bucket is counted on group rank 0
        for piece, lo, hi in zip(pieces, self.offsets[:-1], self.offsets[1:]):
            p = params[piece.param]
            decay[lo:hi] = 0.0 if no_weight_decay(p.name, p) else 1.0
            counted[lo:hi] = holder and sharding_of(p).counted_on(topo)
        counted[self.numel:] = holder
        # the fused kernel decays every value; these few (norms, biases) are then set to their
        # undecayed update, computed alone (see adamw)
        kept = np.flatnonzero(decay[self.start:self.end] == 0).astype(np.int32)
        self.undecayed = Tensor(kept) if kept.size else None
        self.undecayed_state = [Parameter(Tensor(np.zeros(kept.size, np.float32)), name=f"{tag}.undecayed.{k}",
                                          requires_grad=False) for k in STATES]
        self.counted = counted[self.start:self.end]
        self.count_all = bool(self.counted.all())
        self.counted_on_device = None  # the same mask as a float tensor, made on first use off CPU
        # Parameters (not tensors) because the fused AdamW kernel updates them in place; the copy
        # lets the flat of the whole bucket go
        # a ZeRO-3 slice (float32, its own bucket) is its master weight: updated where it lies,
        # not held twice (4 N / D bytes fewer)
        self.aliased = (group.kind == ZERO3_GROUP and not offload and len(pieces) == 1
                        and params[pieces[0].param].dtype == ms.float32)
        if self.aliased:
            self.master = params[pieces[0].param]
        else:
            self.master = Parameter(self.flat(params)[self.start:self.end].copy(), name=f"{tag}.master",
                                    requires_grad=False)
        self.exp_avg = Parameter(ops.zeros_like(self.master), name=f"{tag}.exp_avg", requires_grad=False)
        self.exp_avg_sq = Parameter(ops.zeros_like(self.master), name=f"{tag}.exp_avg_sq", requires_grad=False)
        self.host: Optional[Dict[str, np.ndarray]] = None  # the state in host memory (optim.offload)
        if offload:
            self.host = {key: getattr(self, key).asnumpy().copy() for key in STATES}
            self.master = self.exp_avg = self.exp_avg_sq = None

    @contextlib.contextmanager
    def resident(self):
        """The state on the device for one update. Offloaded (optim.offload: optimizer), it is
        streamed in from host memory and back out after the update: the device holds one bucket's
        state at a time, and the update is the same fused kernel on the same values (the results
        are those of the resident run, bit for bit)."""
        if self.host is None:
            yield
            return
        for key in STATES:
            setattr(self, key, Parameter(Tensor(self.host[key]), name=f"{self.tag}.{key}", requires_grad=False))
        try:
            yield
        finally:
            for key in STATES:
                self.host[key] = getattr(self, key).asnumpy().copy()
                setattr(self, key, None)

    def state(self, key: str) -> Tensor:
        """The ``key`` buffer (this rank's slice) as a tensor, from host memory when offloaded."""
        return getattr(self, key) if self.host is None else Tensor(self.host[key])

    def flat(self, values: Sequence) -> Tensor:
        """This bucket's pieces of ``values`` (one tensor per trainable parameter) end to end, fp32, padded."""
        parts = []
        for piece in self.pieces:
            value = values[piece.param].reshape(-1)
            if not piece.is_whole:
                value = value[piece.lo:piece.hi]
            parts.append(as_type(value, ms.float32))
        if self.padded > self.numel:
            parts.append(ops.zeros(self.padded - self.numel, ms.float32))
        return parts[0] if len(parts) == 1 else ops.concat(parts)

    def reduce(self, grads: Sequence, dp: int):
        """This rank's slice of (sum over the group of the flat gradients) / dp, in its own memory
        (a slice of the reduced flat would keep the whole flat alive)."""
        flat = self.flat(grads)
        if self.group.size > 1:
            if self.zero_stage == 2:
                flat = comm.reduce_scatter(flat, self.group)
            else:
                flat = comm.all_reduce(flat, self.group)
                if self.shards > 1:
                    flat = flat[self.start:self.end].copy()
        return flat * (1.0 / dp) if dp > 1 else flat

    def sum_of_squares(self, g):
        """sum g^2 over the values this rank counts. On the CPU path a float: a BLAS dot product on
        the host view of g, 3-4x faster than MindSpore's multiply and reduce (20 against 70-90 ms
        on 45M values). On the device path a (1,) float32 tensor, left on the device (the
        optimizer adds the buckets' and reads the norm once)."""
        if ms.get_context("device_target") == "CPU" and not use_fused():
            host = g.asnumpy()  # the tensor's own memory, no copy
            if not self.count_all:
                host = host[self.counted]
            # float32 dots of 1024 values, summed in float64: one dot over all 45M values in float32
            # is off by ~0.2%
            whole = host.size // 1024 * 1024
            rows, tail = host[:whole].reshape(-1, 1024), host[whole:]
            return float(np.einsum("ij,ij->i", rows, rows).sum(dtype=np.float64) + np.dot(tail, tail))
        if self.count_all:
            return (g * g).sum().reshape(1)
        if self.counted_on_device is None:
            self.counted_on_device = Tensor(self.counted.astype(np.float32))
        return (g * g * self.counted_on_device).sum().reshape(1)

    def adamw(self, g, lr_t, b1, b2, eps_t, wd_t, decays: bool):
        """The fused AdamW on this rank's slice; the hyperparameters are floats or (1,) device
        tensors (the optimizer's device path). ``decays``: whether wd_t may be non-zero (the
        undecayed values then get their own update)."""
        with self.resident():
            self._adamw(g, lr_t, b1, b2, eps_t, wd_t, decays)

    def _adamw(self, g, lr_t, b1, b2, eps_t, wd_t, decays: bool):
        undecayed = self.undecayed if decays else None
        if undecayed is not None:  # the same update without decay, on copies of the few undecayed values
            state = self.undecayed_state
            for copy, full in zip(state, (self.master, self.exp_avg, self.exp_avg_sq)):
                copy.set_data(ops.gather(full, undecayed, 0))
            _fused_adam(*state, lr_t, b1, b2, eps_t, 0.0, ops.gather(g, undecayed, 0))
        _fused_adam(self.master, self.exp_avg, self.exp_avg_sq, lr_t, b1, b2, eps_t, wd_t, g)
        if undecayed is not None:  # (the moments do not depend on the decay: only the weights differ)
            ops.scatter_update(self.master, undecayed, self.undecayed_state[0])

    def write_params(self, whole: WholeParameters):
        """Every parameter this bucket completes set from the (gathered) master weights."""
        if self.aliased:  # the master is the parameter
            return
        flat = self.state("master")
        if self.shards > 1:
            flat = comm.all_gather(flat, self.group)
        if self.padded > self.numel:
            flat = flat[:self.numel]
        # one split for all pieces: a slice per parameter cost ~4 ms each on CPU
        values = ops.split(flat, self.sizes) if len(self.sizes) > 1 else [flat]
        for param, value in self.completed(values, whole):
            p = self.params[param]
            value = value.reshape(p.shape)
            p.set_data(value if value.dtype == p.dtype else value.astype(p.dtype))

    def completed(self, values: Sequence, whole: WholeParameters) -> Iterator[Tuple[int, object]]:
        """(parameter index, its whole flat value) for each parameter whose last piece is here."""
        for piece, value in zip(self.pieces, values):
            done = whole.add(piece, value)
            if done is not None:
                yield piece.param, done

    def whole(self, key: str) -> np.ndarray:
        """The bucket's full ``key`` buffer (ZeRO slices gathered over the group: a collective)."""
        value = self.state(key)
        return (comm.all_gather(value, self.group, 0) if self.shards > 1 else value).asnumpy()

    def host_pieces(self, key: str) -> List[np.ndarray]:
        """The bucket's full ``key`` buffer cut into its pieces (a collective, see `whole`)."""
        flat = self.whole(key)
        return [flat[lo:hi] for lo, hi in zip(self.offsets[:-1], self.offsets[1:])]

    def set_whole(self, key: str, flat: np.ndarray):
        mine = np.ascontiguousarray(flat[self.start:self.end], np.float32)
        if self.host is not None:
            self.host[key] = mine
        else:
            getattr(self, key).set_data(Tensor(mine))

    def state_bytes(self) -> int:
        """Bytes of state in device memory (none between steps when offloaded)."""
        owned = [k for k in STATES if not (k == "master" and self.aliased)]  # an aliased master is the weight
        return 0 if self.host is not None else sum(getattr(self, k).nbytes for k in owned)

    def host_state_bytes(self) -> int:
        """Bytes of state in host memory (optim.offload)."""
        return sum(v.nbytes for v in self.host.values()) if self.host is not None else 0


def plan_buckets(params: Sequence, topo, zero_stage: int,
                 bucket_numel: int) -> Dict[str, Tuple[object, List[List[Piece]]]]:
    """{sync group name: (its Group, the pieces of each of its buckets)} for trainable ``params``
    (only their shapes and sharding specs are read)."""
    members: Dict[str, List[int]] = {}
    for i, p in enumerate(params):
        spec = sharding_of(p)
        members.setdefault(ZERO3_GROUP if spec.flat_over else spec.grad_sync, []).append(i)
    out = {}
    for name, indices in sorted(members.items()):
        # ZeRO-3's slices arrive reduced (mm_parallel.zero3): each rank's own, a group of one
        group = Group((topo.rank,), 0, ZERO3_GROUP) if name == ZERO3_GROUP else topo.groups[name]
        sizes = [int(np.prod(params[i].shape)) for i in indices]
        if name == ZERO3_GROUP:  # each slice a bucket of its own, its own master (Bucket.aliased)
            out[name] = (group, [[Piece(i, 0, size, size)] for i, size in zip(indices, sizes)])
        else:
            out[name] = (group, cut_into_buckets(indices, sizes, bucket_numel, zero_shards(group, zero_stage)))
    return out


def state_bytes_of(params: Sequence, topo, zero_stage: int, bucket_numel: int = DEFAULT_BUCKET_NUMEL) -> int:
    """The bytes `DistributedOptimizer.state_bytes` reports for these trainable parameters: per
    bucket 3 fp32 buffers of this rank's slice. (The update's copies of the undecayed values —
    norms, biases — are a few more, not counted.)"""
    total = 0
    for group, buckets in plan_buckets(params, topo, zero_stage, bucket_numel).values():
        states = len(STATES) - (group.kind == ZERO3_GROUP)  # a ZeRO-3 slice is its own master
        for pieces in buckets:
            _, _, start, end = bucket_slice(sum(p.size for p in pieces), group, zero_stage)
            total += 4 * states * (end - start)
    return total


def step_buffer_values(params: Sequence, topo, zero_stage: int, bucket_numel: int = DEFAULT_BUCKET_NUMEL) -> int:
    """fp32 values a `DistributedOptimizer.step` holds above its start at its worst moment, for
    these trainable parameters (shapes and sharding specs only), as `Bucket` allocates them:

        kept    each bucket's reduced gradient until its update: this rank's 1/D slice under ZeRO,
                the whole bucket without; nothing for a bucket that is a view of one gradient (one
                piece, a one-rank group, dp 1)
        C       the largest bucket: reducing one holds its flat and the reduced copy (2 C);
                gathering one, the gathered flat and (CPU) its parts (2 C), plus the gathered parts
                of the largest parameter cut between buckets (``cut``)

    peak = 2 C + max(kept, cut). (MindSpore's CPU pool and the collectives' buffers add a
    constant, ~0.1 GB here: benchmarks/optimizer_step_memory.py.)"""
    kept = largest = cut = 0
    for group, buckets in plan_buckets(params, topo, zero_stage, bucket_numel).values():
        for pieces in buckets:
            numel = sum(p.size for p in pieces)
            shards, padded, start, end = bucket_slice(numel, group, zero_stage)
            view = len(pieces) == 1 and padded == numel and group.size == 1 and topo.dp.size == 1
            kept += 0 if view else end - start if group.size > 1 else padded
            largest = max(largest, padded)
            cut = max([cut] + [piece.numel for piece in pieces if not piece.is_whole])
    return 2 * largest + max(kept, cut)


