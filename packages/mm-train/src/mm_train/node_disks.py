"""Which ranks share a disk, and so who writes the files every rank of a node reads.

On a shared file system (``checkpoint.shared_fs: true``, the default) one folder is seen by every
rank: global rank 0 writes the files all ranks read (a checkpoint's config, index, trainer_state,
manifest; the initial weights of a pipelined run) and each pipeline stage's writer its own
weights and optimizer state. On node-local disks (``checkpoint.shared_fs: false``: output_dir is
the same path on every node, each on the node's own disk) the first rank of each node writes the
shared files on its node's disk, every stage writer still writes only its own files, and each
checkpoint's manifest records which node holds which file; resuming checks every node's part
(`mm_train.checkpoint.find_latest_on_nodes`).

A rank's node is ``MM_TRAIN_NODE`` (``mm-train launch`` exports its ``--node-rank``), else the
host name (a user's own msrun launch).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import List, Tuple

# Deferred imports: MindSpore and mm-parallel (the CLI starts without loading MindSpore).

NODE_VARIABLE = "MM_TRAIN_NODE"


@dataclass(frozen=True)
class Disks:
    """``shared``: one file system for all; ``nodes[r]``: global rank r's node; ``rank``: this one's."""

    shared: bool
    nodes: Tuple[str, ...]
    rank: int

    @property
    def node(self) -> str:
        return self.nodes[self.rank]

    @property
    def folder_writer(self) -> bool:
        """Whether this rank writes the files its disk's readers share (rank 0, or each node's first)."""
        if self.shared:
            return self.rank == 0
        return self.nodes.index(self.node) == self.rank

    def gather(self, data: bytes, topo) -> List[Tuple[str, bytes]]:
        """(node, data) of every node's folder writer, in rank order (a collective of all ranks;
        the others' ``data`` is ignored)."""
        from mm_parallel import comm

        parts = comm.all_gather_bytes(data if self.folder_writer else b"", topo.world)
        return [(self.nodes[r], part) for r, part in enumerate(parts)
                if self.nodes.index(self.nodes[r]) == r]


def this_node() -> str:
    return os.environ.get(NODE_VARIABLE) or socket.gethostname()


def shared(topo) -> Disks:
    return Disks(True, ("",) * topo.world_size, topo.rank)


def find(topo, shared_fs: bool) -> Disks:
    """Every rank's node (one gather over the world when the disks are node-local)."""
    if shared_fs:
        return shared(topo)
    from mm_parallel import comm

    nodes = tuple(part.decode() for part in comm.all_gather_bytes(this_node().encode(), topo.world))
    return Disks(False, nodes, topo.rank)
