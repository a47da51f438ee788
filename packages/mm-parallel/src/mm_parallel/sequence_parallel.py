"""The sequence-parallel rule for replicated parameters.

Under sequence parallelism each tp rank runs the replicated layers (norms, the row-parallel bias)
on its own slice of the sequence, so its gradient for those parameters covers only that slice:
the true gradient is the sum over the tp group. Mark such parameters, then all-reduce their
gradients over tp before the optimizer step (Megatron's ``sequence_parallel`` attribute).
"""

from typing import Iterable, List, Optional

from mm_parallel import comm
from mm_parallel.sharding import mark_partial_over_tp, sharding_of
from mm_parallel.topology import Group, get_topology


def mark_sequence_parallel(*params):
    """Flag parameters that are replicated over tp but see only a sequence shard (their sharding
    spec's ``partial_over_tp``, mm_parallel.sharding)."""
    for param in params:
        mark_partial_over_tp(param)


def is_sequence_parallel(param) -> bool:
    return sharding_of(param).partial_over_tp


def sync_sequence_parallel_grads(params: Iterable, grads: Iterable, group: Optional[Group] = None) -> List:
    """grads with every flagged parameter's gradient summed over the tp group; others unchanged."""
    group = get_topology().tp if group is None else group
    return [comm.all_reduce(g, group) if is_sequence_parallel(p) else g for p, g in zip(params, grads)]
