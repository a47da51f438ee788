"""What both communication backends share: joining the world, creating groups, cutting chunks."""

from __future__ import annotations

from typing import Dict, Tuple

from mm_parallel.topology import Group


def chunk(x, parts: int, index: int, dim: int):
    """The ``index``-th of ``parts`` equal pieces of ``x`` along ``dim`` (a slice, no copy of the rest)."""
    dim = dim % x.ndim
    size = x.shape[dim] // parts
    return x.narrow(dim, index * size, size)


class Pending:
    """A collective begun and not yet waited on: `wait()` finishes it and returns its result (the
    same one on a second call)."""

    def __init__(self, finish):
        self._finish, self._result = finish, None

    def wait(self):
        if self._finish is not None:
            self._result, self._finish = self._finish(), None
        return self._result


class Backend:
    """Collectives on ``mindspore.mint.distributed``; subclasses supply the ops.

    Group communicators are created lazily, by the members only, the first time the group
    communicates, and cached by their rank tuple: a layout declares many groups (tp, cp, dp, ...)
    of which a run may use few, and creating one costs a rendezvous.
    """

    name = "?"
    asynchronous = False  # whether `all_gather_start` returns before the data has arrived

    def __init__(self):
        self._names: Dict[Tuple[int, ...], str] = {}
        self._world_size = None

    def init_world(self):
        """Join the launcher's world once; return (world_size, rank)."""
        from mindspore.communication import get_group_size, get_rank, init
        from mindspore.communication.management import GlobalComm

        if not GlobalComm.INITED:
            init()
        self._world_size = get_group_size()
        return self._world_size, get_rank()

    def group_name(self, group: Group) -> str:
        ranks = tuple(group.ranks)
        if ranks not in self._names:
            import mindspore.mint.distributed as dist
            from mindspore.communication.management import GlobalComm

            if self._world_size is not None and ranks == tuple(range(self._world_size)):
                self._names[ranks] = GlobalComm.WORLD_COMM_GROUP
            else:
                name = self.new_group(dist, list(ranks))
                if not name:  # MindSpore logs the failure as a warning and returns "", which names no group
                    raise RuntimeError(f"creating the {self.name} communication group of ranks {list(ranks)} failed "
                                       "(MindSpore's warning above says why); every member must create it at the "
                                       "same point, with the world initialised")
                self._names[ranks] = name
        return self._names[ranks]

    def all_gather_start(self, x, group, dim) -> Pending:
        """`all_gather` begun; here done at once (a backend with asynchronous calls overrides it)."""
        out = self.all_gather(x, group, dim)
        return Pending(lambda: out)

    def new_group(self, dist, ranks):
        """The communicator of ``ranks`` from ``dist`` (mindspore.mint.distributed), "" on failure."""
        return dist.new_group(ranks, backend=self.name)

    @staticmethod
    def pair(a: int, b: int) -> Group:
        """The two-rank group {a, b} seen from ``a``; point-to-point transfers travel in it."""
        if a == b:
            raise ValueError(f"rank {a} cannot send to itself")
        ranks = (min(a, b), max(a, b))
        return Group(ranks, ranks.index(a), "pair")
