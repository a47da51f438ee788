"""mm-parallel: Megatron-style parallel primitives for MindSpore (no model code).

    import mm_parallel
    topo = mm_parallel.initialize(mm_parallel.ParallelConfig(tp=2, cp=2))
    y = mm_parallel.comm.all_reduce(x, topo.tp)
"""

from mm_parallel import comm, mappings
from mm_parallel.__about__ import __version__
from mm_parallel.config import ParallelConfig
from mm_parallel.topology import Group, Topology, get_topology, initialize

__all__ = [
    "Group",
    "ParallelConfig",
    "Topology",
    "__version__",
    "comm",
    "get_topology",
    "initialize",
    "mappings",
]
