"""A video recipe's feature cache on node-local disks (``data.features_shared_fs: false``).

Every node builds its part in parallel: each rank encodes its share of the clips into its node's
folder (the same path on every node, on its own disk), then the nodes' folder writers exchange
their indexes (one gather; `mm_data.feature_nodes`) so each folder lists every sample and where it
is. Training then reads from each node's own folder; before the first step every rank works out
which samples it will read in the run's steps (its shares of the sampler's global batches, and the
held-out part validation reads) and the run is refused, on every rank alike, when a node lacks
any of them — naming the shards and the node that holds them, so they can be copied (or the
cache put on a shared file system). An interrupted build resumes: each node's own index says
which samples it already holds.
"""

from __future__ import annotations

import json
from typing import Iterable, Set

# Deferred imports: mm-parallel (collectives) and mm-data.


def shared_fs(recipe) -> bool:
    """Whether the feature cache is one folder every rank sees: data.features_shared_fs, else
    checkpoint.shared_fs (the cache's default folder is under output_dir)."""
    own = getattr(recipe.data, "features_shared_fs", None)
    return recipe.checkpoint.shared_fs if own is None else bool(own)


def exchange_indexes(folder: str, disks, topo) -> None:
    """After every node built its part: each node's folder writer writes the others' indexes."""
    from mm_data.feature_nodes import local_index, write_node_indexes

    parts = disks.gather(local_index(folder) if disks.folder_writer else b"", topo)
    if disks.folder_writer:
        write_node_indexes(folder, parts, disks.node)


def samples_read(sampler, steps: int, held_out: Iterable[int], pairs=None) -> Set[int]:
    """The cache entries this rank reads in ``steps`` steps from the start (its shares of the
    global batches) plus the held-out samples; a pair data set's samples as both clips' entries."""
    reads = set(int(i) for i in held_out)
    for _, (_, _, batch) in zip(range(steps), sampler.positions()):
        reads.update(int(i) for i in sampler.local(batch))
    if pairs is not None:
        reads = {clip for index in reads for clip in pairs[index]}
    return reads


def require_node_part(features, reads: Set[int], disks, topo) -> None:
    """Refuse (ValueError on every rank) a run whose ranks would read features another node holds."""
    from mm_data.feature_nodes import missing_shards
    from mm_parallel import comm

    mine = missing_shards(features, reads)
    parts = comm.all_gather_bytes(json.dumps({"node": disks.node, "missing": mine}).encode(), topo.world)
    lacking = {}
    for part in parts:
        record = json.loads(part)
        lacking.setdefault(record["node"], {}).update(record["missing"])
    lacking = {node: shards for node, shards in lacking.items() if shards}
    if lacking:
        lines = [f"node {node} lacks " + ", ".join(f"{shard} (on node {holder})" for shard, holder in
                                                   sorted(shards.items())[:8]) + ("..." if len(shards) > 8 else "")
                 for node, shards in sorted(lacking.items())]
        raise ValueError("data.features_shared_fs is false and the feature cache at " + features.folder +
                         " is spread over the nodes' own disks, but a node's ranks would read features another node "
                         "holds: " + "; ".join(lines) + ". Copy those shards into that folder on the node that lacks "
                         "them (its index already lists them), or put data.features_dir on a shared file system")
