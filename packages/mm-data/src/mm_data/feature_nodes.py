"""A feature cache spread over node-local disks: every node builds its part, each knows the whole.

With the cache folder on each node's own disk (the same path on every node), each rank encodes
its share into its node's folder (`build_feature_cache`: ``index-rRRR.jsonl`` and its shards).
The nodes then exchange their indexes (`local_index` -> a gather -> `write_node_indexes`): each
folder gets ``index-node-NODE.jsonl`` for every other node — the samples held there, each entry
with its ``node`` — so `FeatureDataset` on any node lists every sample, in one order, and
`missing_shards` names what a node's ranks would read that is on another node's disk. A node whose
part is missing simply encodes it again on the next build (its own index says what it holds).
"""

from __future__ import annotations

import glob
import json
import os
from typing import Dict, Iterable, List, Tuple

NODE_INDEX = "index-node-{node}.jsonl"


def rank_entries(folder: str) -> List[dict]:
    """The entries of the folder's own index (its ranks' ``index-rRRR.jsonl``)."""
    entries = []
    for path in sorted(glob.glob(os.path.join(folder, "index-r*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            entries += [json.loads(line) for line in f if line.strip()]
    return entries


def local_index(folder: str) -> bytes:
    """This node's index lines (its ranks' ``index-r*.jsonl``), as sent to the other nodes."""
    return "".join(json.dumps(entry) + "\n" for entry in rank_entries(folder)).encode()


def write_node_indexes(folder: str, parts: Iterable[Tuple[str, bytes]], this_node: str) -> None:
    """Each other node's index lines into ``index-node-NODE.jsonl`` (written whole, then renamed)."""
    for node, data in parts:
        if node == this_node:
            continue
        lines = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
        path = os.path.join(folder, NODE_INDEX.format(node=node))
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({**entry, "node": node}) + "\n" for entry in lines)
        os.replace(path + ".tmp", path)


def node_entries(folder: str) -> List[dict]:
    """The entries other nodes hold (their ``index-node-*.jsonl``)."""
    entries = []
    for path in sorted(glob.glob(os.path.join(folder, NODE_INDEX.format(node="*")))):
        with open(path, encoding="utf-8") as f:
            entries += [json.loads(line) for line in f if line.strip()]
    return entries


def missing_shards(dataset, indices: Iterable[int]) -> Dict[str, str]:
    """{shard: the node that holds it} of the samples ``indices`` of a `FeatureDataset` whose
    shard is not in this node's folder."""
    missing = {}
    for index in indices:
        entry = dataset.entries[index]
        if not os.path.isfile(os.path.join(dataset.folder, entry["shard"])):
            missing[entry["shard"]] = entry.get("node", "another node")
    return missing
