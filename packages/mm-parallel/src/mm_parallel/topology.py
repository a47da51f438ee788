"""Process groups: where each rank sits in the tp x cp x dp x pp grid, and the groups it belongs to.

Rank order is tp -> cp -> ep -> dp -> pp, tp varying fastest (Megatron-Core's default), i.e.

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

World of 8 with tp=2, cp=2, dp=2, pp=1 (each cell a global rank):

                 cp_rank 0     cp_rank 1
    dp_rank 0    [0, 1]        [2, 3]        <- a tp group is one cell: [0,1], [2,3], ...
    dp_rank 1    [4, 5]        [6, 7]
                  cp groups: [0,2] [1,3] [4,6] [5,7]      dp groups: [0,4] [1,5] [2,6] [3,7]

Expert parallel does not add a dimension: the dp*cp ranks with the same tp and pp position are
renumbered j = cp_rank + cp * dp_rank and cut into ep groups of consecutive j (Megatron-Core's
expert decomposition tp -> ep -> edp -> pp with expert tp = tp). In the grid above with ep=2 the
expert groups are [0,2] [4,6] [1,3] [5,7] and the expert-data-parallel groups [0,4] [2,6] ...

A hybrid context-parallel group (cp = ulysses x ring) is cut the same way: Ulysses groups of
consecutive cp ranks inside, ring groups across them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from mm_parallel.config import ParallelConfig


@dataclass(frozen=True)
class Group:
    """A process group seen from one of its members.

    ranks: the global ranks, ascending; rank: this process's index inside ``ranks``.
    The communicator behind it is created on first use by the comm backend (only members
    create a group, so creation happens where the members first communicate together).
    """

    ranks: Tuple[int, ...]
    rank: int
    kind: str = "group"

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def global_rank(self) -> int:
        """This process's global rank."""
        return self.ranks[self.rank]

    def group_rank_of(self, global_rank: int) -> int:
        """Index inside this group of ``global_rank``; ValueError if it is not a member."""
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(f"rank {global_rank} is not in the {self.kind} group {list(self.ranks)}") from None

    def __repr__(self) -> str:
        return f"Group({self.kind}, ranks={list(self.ranks)}, rank={self.rank})"


RANKS_PER_NODE = "MM_RANKS_PER_NODE"  # set by mm_parallel.launch: the workers on each node
ZERO3_KINDS = ("dp_cp", "edp")  # the gradient groups ZeRO-3 cuts weights over


def rank_grid(config: ParallelConfig, world_size: int) -> Dict[str, List[List[int]]]:
    """Every group of every kind as lists of global ranks (pure but for the launcher's
    ``MM_RANKS_PER_NODE`` when the config leaves ranks_per_node unset: no communication).

    Kinds: tp, cp, dp, pp, dp_cp (the ranks ZeRO shards over), ep, edp (expert data parallel),
    cp_ulysses and cp_ring (the two factors of a hybrid cp; one of them is trivial otherwise),
    and for dp_cp and edp ZeRO-3's ``<kind>_shard`` (the ranks a weight is cut over) and
    ``<kind>_replica`` (the ranks holding the same slice: one per node under zero3_shard node).
    """
    dp = config.data_parallel_size(world_size)
    tp, cp, pp, ep = config.tp, config.cp, config.pp, config.ep
    grid = np.arange(world_size).reshape(pp, dp, cp, tp)  # C order: the last axis (tp) varies fastest

    def along(array: np.ndarray, axes: Sequence[int]) -> List[List[int]]:
        keep = [a for a in range(array.ndim) if a not in axes]
        moved = np.transpose(array, keep + list(axes))
        size = int(np.prod([array.shape[a] for a in axes]))
        return sorted(sorted(int(r) for r in row) for row in moved.reshape(-1, size))

    expert = grid.reshape(pp, dp * cp // ep, ep, tp)  # j = cp_rank + cp * dp_rank, cut into ep blocks
    hybrid = grid.reshape(pp, dp, config.ring_size, config.ulysses_size, tp)
    groups = {
        "tp": along(grid, [3]),
        "cp": along(grid, [2]),
        "dp": along(grid, [1]),
        "pp": along(grid, [0]),
        "dp_cp": along(grid, [1, 2]),
        "ep": along(expert, [2]),
        "edp": along(expert, [1]),
        "cp_ulysses": along(hybrid, [3]),
        "cp_ring": along(hybrid, [2]),
    }
    per_node = config.ranks_per_node or int(os.environ.get(RANKS_PER_NODE, 0)) or world_size
    for kind in ZERO3_KINDS:  # ZeRO-3's shard and replica groups of each gradient group
        groups[kind + "_shard"], groups[kind + "_replica"] = zero3_groups(
            groups[kind], per_node if config.zero3_shard == "node" else world_size)
    return groups


def zero3_groups(rows: List[List[int]], per_node: int) -> Tuple[List[List[int]], List[List[int]]]:
    """(shard, replica) groups of gradient groups ``rows`` on nodes of ``per_node`` consecutive
    ranks: a shard group is a row's ranks on one node, a replica group the ranks at the same place
    in the row's shard groups (one per node). One node: shard = the row, replicas of one rank."""
    shards, replicas = [], []
    for row in rows:
        parts = [[r for r in row if r // per_node == node] for node in sorted({r // per_node for r in row})]
        if len({len(p) for p in parts}) != 1:
            raise ValueError(f"zero3_shard=node: the ranks {row} share gradients but sit unevenly on nodes of "
                             f"{per_node} ranks; use zero3_shard=all or a layout that tiles the nodes")
        shards += parts
        replicas += [list(r) for r in zip(*parts)]
    return sorted(shards), sorted(replicas)


@dataclass
class Topology:
    """This process's place in the parallel layout.

    ``tp``, ``cp``, ``ep``, ``dp``, ``pp`` are the DESIGN groups; ``dp_cp`` is the ZeRO sharding
    group (data and context parallel ranks hold the same parameters), ``edp`` the group that
    averages expert gradients, ``cp_ulysses`` / ``cp_ring`` the factors of a hybrid cp.
    """

    config: ParallelConfig
    world_size: int
    rank: int
    groups: Dict[str, Group] = field(repr=False)

    def __getattr__(self, name: str) -> Group:
        groups = self.__dict__.get("groups", {})
        if name in groups:
            return groups[name]
        raise AttributeError(name)

    @property
    def world(self) -> Group:
        return Group(tuple(range(self.world_size)), self.rank, "world")

    def zero3_shard(self, kind: str) -> Group:
        """The ranks ZeRO-3 cuts a weight of gradient group ``kind`` (dp_cp, edp) over."""
        return self.groups[kind + "_shard"]

    def zero3_replicas(self, kind: str) -> Group:
        """The ranks holding this rank's ZeRO-3 slice of gradient group ``kind`` (one per node
        under hybrid sharding, this rank alone otherwise)."""
        return self.groups[kind + "_replica"]

    @property
    def is_first_stage(self) -> bool:
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1

    def describe(self) -> str:
        parts = [f"{k}={g.size}" for k, g in self.groups.items() if k in ("tp", "cp", "ep", "dp", "pp")]
        return f"rank {self.rank}/{self.world_size}: " + " ".join(parts)

    @classmethod
    def build(cls, config: ParallelConfig, world_size: int, rank: int) -> "Topology":
        """The topology of ``rank`` in a world of ``world_size`` (pure: no communication)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        groups = {}
        for kind, rows in rank_grid(config, world_size).items():
            row = next(r for r in rows if rank in r)
            groups[kind] = Group(tuple(row), row.index(rank), kind)
        return cls(config, world_size, rank, groups)


_DEFAULT: Optional[Topology] = None

# Environment variables that mean a launcher started this process as one of several workers.
_LAUNCHER_VARS = ("MS_ROLE", "MS_WORKER_NUM", "RANK_TABLE_FILE")


def launched() -> bool:
    """True when ``msrun`` (or an Ascend rank table) started this process as a worker."""
    return any(os.environ.get(v) for v in _LAUNCHER_VARS)


def set_default(topology: Topology) -> Topology:
    """Make ``topology`` the one every ``topology=None`` means (`mm_parallel.world.initialize` calls it)."""
    global _DEFAULT
    _DEFAULT = topology
    return topology


def get_topology(topology: Optional[Topology] = None) -> Topology:
    """``topology`` if given, else the one from ``initialize``; a world of one when not launched."""
    if topology is not None:
        return topology
    if _DEFAULT is None:
        if launched():
            raise RuntimeError(
                "this process was started by a launcher but mm_parallel.initialize(config) was not called; "
                "call it once at start-up before using the parallel layers"
            )
        return Topology.build(ParallelConfig(), 1, 0)
    return _DEFAULT
