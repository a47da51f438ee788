"""`ParallelConfig`: the parallel layout a user asks for, checked before any process group exists.

Every degree except data parallel is given; data parallel is whatever the world size leaves:
``dp = world_size / (tp * cp * pp)``. Expert parallel does not multiply the world: the ``ep``
expert groups are carved out of the ``dp * cp`` ranks that share a tensor/pipeline position
(as Megatron-Core does), so ``ep`` must divide ``dp * cp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

CP_ALGORITHMS = ("ulysses", "ring", "hybrid")
ZERO_STAGES = (0, 1, 2, 3)
ZERO3_SHARDS = ("all", "node")


@dataclass(frozen=True)
class ParallelConfig:
    """The degrees of each parallel dimension.

    tp: tensor parallel; pp: pipeline stages; vpp: virtual (interleaved) chunks per stage;
    cp: context parallel, split by ``cp_algo`` ("ulysses" all-to-all, "ring" attention, or
    "hybrid" = Ulysses of ``ulysses_degree`` inside x Ring of ``cp / ulysses_degree`` across);
    ep: expert parallel (inside dp x cp); expert_tp: the tensor parallelism of each expert, 1
    (experts whole on every tp rank) or tp (each expert's intermediate dim split over tp, the
    default); sequence_parallel: shard activations along the sequence
    inside the TP group (needs tp > 1); zero_stage: 0 plain DP, 1 sharded optimizer state,
    2 sharded state and gradients, 3 the weights too (mm_parallel.zero3: the linear weights of at
    least ``zero3_min_numel`` values); pp_layers: the pipelined stack's layers per stage when they
    are not cut evenly, pp counts (vpp > 1: vpp lists of pp counts, chunk c of stage s being virtual
    stage c * pp + s), as the reference suite's ``pipeline_num_layers`` (mm_parallel.pipeline).
    """

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    cp_algo: str = "ulysses"
    ulysses_degree: Optional[int] = None
    ep: int = 1
    expert_tp: Optional[int] = None
    sequence_parallel: bool = False
    zero_stage: int = 0
    zero3_min_numel: int = 2 ** 16  # zero_stage 3: smaller weights stay whole (mm_parallel.zero3)
    # zero_stage 3: false keeps each gathered weight from its first forward to the step's end (one
    # gather per weight and step, whole weights in memory meanwhile), as FSDP's reshard_after_forward
    reshard_after_forward: bool = True
    # zero_stage 3: "all" cuts each weight over its whole gradient group; "node" over the group's
    # ranks on one node, replicated across nodes (hybrid sharding: the gathers stay on the node's
    # links, the gradient is reduce-scattered there, then all-reduced across nodes)
    zero3_shard: str = "all"
    # the ranks each node runs (for zero3_shard node); None: the launcher's (MM_RANKS_PER_NODE),
    # else the whole world as one node
    ranks_per_node: Optional[int] = None
    # an uneven split of the pipelined layers over the stages (None: even); stored as tuples
    pp_layers: Optional[Union[Tuple[int, ...], Tuple[Tuple[int, ...], ...]]] = None

    def __post_init__(self):
        for name in ("tp", "pp", "vpp", "cp", "ep", "zero3_min_numel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelConfig.{name} must be a positive integer, got {value!r}")
        if self.cp_algo not in CP_ALGORITHMS:
            raise ValueError(
                f"ParallelConfig.cp_algo={self.cp_algo!r} is unknown; use one of {', '.join(CP_ALGORITHMS)}"
            )
        if self.zero3_shard not in ZERO3_SHARDS:
            raise ValueError(f"ParallelConfig.zero3_shard={self.zero3_shard!r} is unknown; use "
                             f"{' or '.join(ZERO3_SHARDS)}")
        if self.ranks_per_node is not None and (isinstance(self.ranks_per_node, bool)
                                                or not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1):
            raise ValueError(f"ParallelConfig.ranks_per_node must be a positive integer or unset, got "
                             f"{self.ranks_per_node!r}")
        if self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"ParallelConfig.zero_stage={self.zero_stage!r} is unknown; use 0, 1, 2 or 3")
        if self.vpp > 1 and self.pp == 1:
            raise ValueError(
                f"vpp={self.vpp} needs pipeline parallelism: interleaved chunks exist only with pp > 1; "
                "set pp > 1 or vpp=1"
            )
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(
                "sequence_parallel=True shards activations over the tensor-parallel group; it needs tp > 1"
            )
        self._check_ulysses_degree()
        self._check_pp_layers()
        if self.expert_tp is not None and self.expert_tp not in (1, self.tp):
            raise ValueError(f"expert_tp={self.expert_tp!r} must be 1 (whole experts on every tp rank) or tp={self.tp} "
                             "(each expert split over the tp group)")

    @property
    def expert_tp_size(self) -> int:
        """The tensor parallelism of each expert: ``expert_tp``, by default tp."""
        return self.tp if self.expert_tp is None else self.expert_tp

    def _check_ulysses_degree(self):
        u = self.ulysses_degree
        if self.cp_algo != "hybrid":
            if u is not None and u != (self.cp if self.cp_algo == "ulysses" else 1):
                raise ValueError(
                    f"ulysses_degree={u} applies only to cp_algo='hybrid' (with cp_algo={self.cp_algo!r} "
                    "leave it unset)"
                )
            return
        if u is None:
            raise ValueError("cp_algo='hybrid' needs ulysses_degree (cp = ulysses_degree x ring size)")
        if isinstance(u, bool) or not isinstance(u, int) or u < 1 or self.cp % u != 0:
            raise ValueError(
                f"ulysses_degree={u!r} must be a positive divisor of cp={self.cp} "
                "(cp = ulysses_degree x ring size)"
            )

    def _check_pp_layers(self):
        """pp_layers: pp positive counts, or vpp lists of them; kept as (nested) tuples. Their sum
        against the model's layers is the model's check (mm_parallel.pipeline.stage_layer_ranges)."""
        given = self.pp_layers
        if given is None:
            return
        expected = f"a list of {self.pp} layer counts" if self.vpp == 1 else f"{self.vpp} lists of {self.pp} counts"
        nested = isinstance(given, (list, tuple)) and bool(given) and isinstance(given[0], (list, tuple))
        rows = given if nested else [given]
        if (not isinstance(given, (list, tuple)) or nested != (self.vpp > 1) or len(rows) != self.vpp
                or any(not isinstance(r, (list, tuple)) or len(r) != self.pp for r in rows)
                or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for r in rows for n in r)):
            raise ValueError(f"parallel.pp_layers must be {expected}, each at least 1 (pp={self.pp}, vpp={self.vpp}), "
                             f"got {given!r}")
        value = tuple(tuple(r) for r in rows) if nested else tuple(given)
        object.__setattr__(self, "pp_layers", value)

    @property
    def ulysses_size(self) -> int:
        """Ranks that exchange heads by all-to-all inside one context-parallel group."""
        if self.cp_algo == "ulysses":
            return self.cp
        if self.cp_algo == "ring":
            return 1
        return self.ulysses_degree

    @property
    def ring_size(self) -> int:
        """Ranks that pass key/value blocks round a ring inside one context-parallel group."""
        return self.cp // self.ulysses_size

    def data_parallel_size(self, world_size: int) -> int:
        """dp = world_size / (tp * cp * pp); raises ValueError when the layout does not tile the world."""
        model = self.tp * self.cp * self.pp
        if world_size % model != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by tp*cp*pp = {self.tp}*{self.cp}*{self.pp} = {model}; "
                "change the degrees or the number of processes"
            )
        dp = world_size // model
        if (dp * self.cp) % self.ep != 0:
            raise ValueError(
                f"ep={self.ep} must divide dp*cp = {dp}*{self.cp} = {dp * self.cp} "
                "(expert groups are carved out of the data- and context-parallel ranks)"
            )
        return dp
