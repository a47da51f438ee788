"""Per-parameter sharding: how a parameter is laid out over the ranks, how its gradient is
synchronised, and how its Hugging Face tensor maps to this rank's slice.

    ParamSharding(splits=((dim, group), ...), grad_sync="dp_cp" | "edp", partial_over_tp=False, fused=())

splits           dims cut into equal parts over named groups of the topology ("tp", "ep"): rank r
                 of group g holds rows [r n / g, (r + 1) n / g) of dim d. Expert tensor parallelism
                 cuts one dim over ep (the experts) and another over tp.
fused            a Hugging Face tensor that concatenates parts along its tp-split dim (q | k | v,
                 gate | up): each part is cut alone and the local slice is [part 0's slice | part
                 1's slice | ...], what a column-parallel layer computing every part at once needs.
grad_sync        the replicas whose gradients are averaged: "dp_cp" for dense parameters (every
                 data and context parallel rank holds them), "edp" for experts (the ranks holding
                 the same experts: the dp_cp ranks of one ep rank).
partial_over_tp  replicated over tp, but a tp rank's gradient covers only its part (its sequence
                 shard under sequence parallelism, its output rows for LoRA A of a column layer):
                 the gradient is the sum over tp (Megatron's ``sequence_parallel`` attribute).
flat_over        ZeRO-3 (mm_parallel.zero3): the parameter holds only this rank's slice of the
                 flattened tp / ep-local tensor (``local_shape``), padded to a multiple of the
                 shard group of ``flat_over`` (its grad_sync group: all of it, or its ranks on
                 one node under hybrid sharding, replicated across nodes) and cut into equal
                 slices; its gradient arrives summed over the whole grad_sync group (by its region).

The spec lives on the Parameter (``param.sharding``, as Megatron keeps parameter attributes), set
by the layer that makes it; a parameter without one is replicated and dense. Checkpoint loading
and saving (hf_checkpoint), the optimizer, LoRA and the trainer's checkpoints all read it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Tuple

import numpy as np

GROUPS = ("tp", "ep")
GRAD_SYNC = ("dp_cp", "edp")


@dataclass(frozen=True)
class ParamSharding:
    """See the module docstring."""

    splits: Tuple[Tuple[int, str], ...] = ()
    grad_sync: str = "dp_cp"
    partial_over_tp: bool = False
    fused: Tuple[int, ...] = ()
    flat_over: Optional[str] = None
    local_shape: Tuple[int, ...] = ()

    def __post_init__(self):
        groups = [g for _, g in self.splits]
        if any(g not in GROUPS for g in groups) or len(set(groups)) != len(groups):
            raise ValueError(f"splits {self.splits}: each group once, among {GROUPS}")
        if len({d for d, _ in self.splits}) != len(self.splits):
            raise ValueError(f"splits {self.splits}: a dim can be split over one group only")
        if self.grad_sync not in GRAD_SYNC:
            raise ValueError(f"grad_sync {self.grad_sync!r} is not one of {GRAD_SYNC}")
        if self.fused and self.dim("tp") is None:
            raise ValueError("fused parts are cut along the tp-split dim: give a tp split")
        if self.flat_over not in (None,) + GRAD_SYNC or (self.flat_over is not None) != bool(self.local_shape):
            raise ValueError(f"flat_over {self.flat_over!r} needs local_shape and is one of {GRAD_SYNC}")

    @property
    def sharded(self) -> bool:
        """Whether this rank holds less than the whole tensor (split, or ZeRO-3's flat slice)."""
        return bool(self.splits) or self.flat_over is not None

    def flat_group(self, topology):
        """ZeRO-3: the group the slices are cut over (``<flat_over>_shard``, mm_parallel.topology)."""
        return topology.zero3_shard(self.flat_over)

    def flat_slice(self, local, topology):
        """ZeRO-3: this rank's slice of the tp / ep-local ``local`` (numpy), flattened and padded."""
        group = self.flat_group(topology)
        flat = np.asarray(local).reshape(-1)
        per_rank = -(-flat.size // group.size)
        flat = np.pad(flat, (0, per_rank * group.size - flat.size))
        return flat[group.rank * per_rank:(group.rank + 1) * per_rank]

    def unflatten(self, flat_slice, topology):
        """ZeRO-3: the tp / ep-local tensor from every rank's flat slice (an all-gather over `flat_group`)."""
        return self.unflatten_start(flat_slice, topology).wait()

    def unflatten_start(self, flat_slice, topology):
        """`unflatten` begun (`mm_parallel.comm.all_gather_start`): its ``wait()`` gives the tensor."""
        from mm_parallel import comm

        gathering = comm.all_gather_start(flat_slice, self.flat_group(topology), 0)
        numel = int(np.prod(self.local_shape))
        return comm.Pending(lambda: gathering.wait()[:numel].reshape(self.local_shape))

    def dim(self, group: str) -> Optional[int]:
        """The dim split over ``group``, or None."""
        return next((d for d, g in self.splits if g == group), None)

    def local_index(self, full_shape, topology) -> tuple:
        """The index of this rank's slice in the full tensor (slices; an index array along a fused dim)."""
        index = [slice(None)] * len(full_shape)
        for dim, name in self.splits:
            group = topology.groups[name]
            length = full_shape[dim]
            parts = self.fused if (name == "tp" and self.fused) else (length,)
            if sum(parts) != length:
                raise ValueError(f"fused parts {parts} do not add up to dim {dim} of shape {tuple(full_shape)}")
            if any(p % group.size for p in parts):
                raise ValueError(f"dim {dim} of shape {tuple(full_shape)} (parts {parts}) cannot be split over "
                                 f"{name}={group.size}; choose a {name} that divides it")
            if len(parts) == 1:
                size = length // group.size
                index[dim] = slice(group.rank * size, (group.rank + 1) * size)
            else:  # this rank's block of the rows every rank holds, in rank order
                index[dim] = self.fused_rows(group.size).reshape(group.size, -1)[group.rank]
        return tuple(index)

    def local(self, full, topology):
        """This rank's slice of a full array (numpy or Tensor; ZeRO-3's flat slice: numpy)."""
        local = full[self.local_index(tuple(full.shape), topology)] if self.splits else full
        return self.flat_slice(local, topology) if self.flat_over else local

    def gather(self, local, topology):
        """The full tensor from every rank's slice (all-gathers over ZeRO-3's group and the split
        groups: a collective every member calls)."""
        from mindspore import Tensor, ops

        from mm_parallel import comm

        if self.flat_over:
            local = self.unflatten(local, topology)
        for dim, name in reversed(self.splits):
            group = topology.groups[name]
            if group.size == 1:
                continue
            local = comm.all_gather(local, group, dim)
            if name == "tp" and self.fused:  # [rank 0's parts | rank 1's parts ...] -> [part 0 | part 1 ...]
                order = np.argsort(self.fused_rows(group.size))
                local = ops.gather(local, Tensor(order.astype(np.int32)), dim)
        return local

    def fused_rows(self, size: int) -> np.ndarray:
        """The full tensor's rows (of the fused dim) that tp ranks 0..size-1 hold, concatenated in rank order."""
        parts, starts = self.fused, np.concatenate([[0], np.cumsum(self.fused)[:-1]])
        return np.concatenate([s + r * (p // size) + np.arange(p // size) for r in range(size)
                               for s, p in zip(starts, parts)])

    def counted_on(self, topology) -> bool:
        """Whether this rank counts the parameter's values in a global norm: once over the tp
        ranks that hold a replica (those not split over tp: tp rank 0), a ZeRO-3 slice once over
        the nodes that hold it (hybrid sharding: replica rank 0)."""
        if self.flat_over and topology.zero3_replicas(self.flat_over).rank != 0:
            return False
        return self.dim("tp") is not None or topology.tp.rank == 0 or topology.tp.size == 1


REPLICATED = ParamSharding()


def sharding_of(param) -> ParamSharding:
    """The parameter's spec (replicated and dense if it has none)."""
    return getattr(param, "sharding", None) or REPLICATED


def set_sharding(param, spec: ParamSharding):
    """Attach ``spec`` to ``param``; returns the parameter."""
    param.sharding = spec
    return param


def split(param, *splits: Tuple[int, str], **options):
    """Declare ``param`` split, e.g. split(w, (0, "tp")) or split(w, (0, "ep"), (2, "tp"), grad_sync="edp")."""
    return set_sharding(param, ParamSharding(splits=tuple(splits), **options))


def mark_partial_over_tp(param):
    """The parameter's gradient is partial over tp (sequence-parallel norms, LoRA A): summed over tp."""
    return set_sharding(param, replace(sharding_of(param), partial_over_tp=True))
