"""mm-parallel: Megatron-style parallel primitives for MindSpore (no model code).

    import mm_parallel
    topo = mm_parallel.initialize(mm_parallel.ParallelConfig(tp=2, cp=2))
    y = mm_parallel.comm.all_reduce(x, topo.tp)

Importing it on CPU switches MindSpore to blocking op launch, which custom-bprop Cells need for
correct gradients (see mm_parallel.runtime): import mm_parallel before running any op. It also
registers the exit hook that lets a process end without a fault in MindSpore's teardown
(mm_parallel.clean_exit).
"""

from mm_parallel import clean_exit, runtime

runtime.configure()
clean_exit.install()  # pyboost's last operator emptied before MindSpore's teardown (clean_exit's docstring)

from mm_parallel import comm, lora, mappings, model_base, moe, ops, pipeline, recompute, sharding, stage_io
from mm_parallel.__about__ import __version__
from mm_parallel.config import ParallelConfig
from mm_parallel.context_parallel import attention, gather_sequence, split_sequence
from mm_parallel.lr_schedule import LRSchedule
from mm_parallel.moe import MoELayer
from mm_parallel.optimizer import DistributedOptimizer, OptimizerConfig
from mm_parallel.sequence_parallel import mark_sequence_parallel, sync_sequence_parallel_grads
from mm_parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    shard,
    unshard,
    vocab_parallel_cross_entropy,
)
from mm_parallel.topology import Group, Topology, get_topology
from mm_parallel.world import initialize

__all__ = [
    "ColumnParallelLinear",
    "DistributedOptimizer",
    "Group",
    "LRSchedule",
    "MoELayer",
    "OptimizerConfig",
    "ParallelConfig",
    "RowParallelLinear",
    "Topology",
    "VocabParallelEmbedding",
    "__version__",
    "attention",
    "comm",
    "gather_sequence",
    "get_topology",
    "initialize",
    "lora",
    "mappings",
    "model_base",
    "moe",
    "mark_sequence_parallel",
    "ops",
    "pipeline",
    "recompute",
    "shard",
    "sharding",
    "split_sequence",
    "stage_io",
    "sync_sequence_parallel_grads",
    "unshard",
    "vocab_parallel_cross_entropy",
]
