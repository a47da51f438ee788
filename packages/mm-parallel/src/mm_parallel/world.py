"""Joining the launcher's world: `initialize` starts the collectives, sets the default topology
and has the ranks agree on which native CPU kernels they use (`ops.native.agree_across_ranks`).

It sits above both `topology` (the layout's arithmetic, no communication) and `comm` (which
needs a topology's groups), so neither of those imports the other's way up.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np
from mindspore import Tensor

from mm_parallel.comm import get_backend
from mm_parallel.config import ParallelConfig
from mm_parallel.ops import native
from mm_parallel.topology import Topology, launched, set_default


def initialize(config: Optional[ParallelConfig] = None) -> Topology:
    """Join the launcher's world (if any), check the layout against it, and make it the default.

    Under ``msrun`` this calls ``mindspore.communication.init()``; without a launcher the world is
    one process and nothing communicates. Raises ValueError when the layout does not fit the world.
    """
    config = config or ParallelConfig()
    world_size, rank = get_backend().init_world() if launched() else (1, 0)
    topology = set_default(Topology.build(config, world_size, rank))
    if world_size > 1:
        native.agree_across_ranks(lambda flags: _minimum_over_ranks(flags, topology))
    return topology


def _minimum_over_ranks(flags: List[int], topology: Topology) -> List[int]:
    summed = get_backend().all_reduce(Tensor(np.array(flags, np.int32)), topology.world, "min")
    return [int(v) for v in summed.asnumpy()]
