"""data.encoder_dp: the ranks that train the same micro-batches encode different ones and gather the features.

Tensor and context parallelism split one sample's work, not the samples: the g = tp x cp ranks of a
data-parallel rank (and pipeline stage) hold the same micro-batches. Online encoding (data.online)
without this has each of them run the VAE and the text encoder on every micro-batch of its step,
g copies of the same work. With it (MindSpeed-MM's enable_encoder_dp) the step's m micro-batches
are encoded in rounds of g, micro-batch r g + k by the group's rank k, and each round's features
are all-gathered:

    features[r g + k] = all_gather_k( encode(batch[r g + k]) )[k]        (k < m - r g)

so a rank encodes ceil(m / g) micro-batches instead of m. In a last round of fewer than g, the
spare ranks encode its first micro-batch again (a gather takes one shape from every rank) and
their copies are dropped. Encoding is deterministic (the VAE's latent means; CogVideoX's image
noise drawn from (seed, step, sample)), so every rank ends with the features it would have
encoded itself.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import numpy as np

# Deferred imports: MindSpore and mm-parallel (the CLI starts without loading MindSpore).


def encoder_group(topo):
    """The ranks holding this rank's micro-batches (its tp x cp block: tp varies fastest, then cp,
    mm_parallel.topology.rank_grid), or None when it is this rank alone."""
    from mm_parallel.topology import Group

    n = topo.tp.size * topo.cp.size
    if n == 1:
        return None
    first = topo.rank - topo.rank % n
    return Group(tuple(range(first, first + n)), topo.rank % n, "encoder_dp")


def rounds(micro_batches: int, group_size: int, rank: int) -> List[int]:
    """The micro-batch ``rank`` of the group encodes in each round (module docstring)."""
    starts = range(0, micro_batches, group_size)
    return [start + rank if start + rank < micro_batches else start for start in starts]


def encode_shared(batches: List[Dict], encode: Callable[[Dict], Dict[str, np.ndarray]], group) -> List[Dict]:
    """``encode(batch)`` of every micro-batch in ``batches``, each encoded by one rank of ``group``
    (None: all here) and gathered (module docstring)."""
    if group is None:
        return [encode(batch) for batch in batches]
    import mindspore as ms

    from mm_parallel import comm

    out: List[Optional[Dict]] = [None] * len(batches)
    for start, mine in zip(range(0, len(batches), group.size), rounds(len(batches), group.size, group.rank)):
        features = encode(batches[mine])
        gathered = {name: comm.all_gather(ms.Tensor(np.ascontiguousarray(value)[None]), group).asnumpy()
                    for name, value in sorted(features.items())}
        for k in range(min(group.size, len(batches) - start)):
            out[start + k] = {name: value[k] for name, value in gathered.items()}
    return out
