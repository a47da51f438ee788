"""Collectives on `Group`s: one API, two backends (native HCCL on Ascend, emulated on CPU mccl).

Every function returns a result and leaves its input alone. A group of size one is the identity:
the input comes back as it is and nothing is communicated. Shapes are checked before anything is
sent, so a bad shape raises ValueError on every rank instead of hanging one of them. Every call
is noted for `mm_parallel.comm.watchdog` (a wait past a timeout names the rank that never came).
These functions are not differentiable; `mm_parallel.mappings` wraps them with their backward.

    all_reduce(x, g, op)        every rank gets op(x_0, ..., x_{n-1})          op: sum avg max min
    all_gather(x, g, dim)       every rank gets cat(x_0, ..., x_{n-1}; dim)     (group-rank order)
    all_gather_start(x, g, dim) the same, begun: ``.wait()`` gives it (asynchronous on HCCL)
    all_gather_bytes(b, g)      every rank gets [b_0, ..., b_{n-1}]: byte strings of any lengths
    reduce_scatter(x, g, dim)   rank i gets chunk i (along dim) of sum_j x_j
    all_to_all(x, g, s, c)      rank i gets cat_j(chunk i along s of x_j; along c)
    all_to_all_v(x, g, s, r)    rank i gets cat_j(rows of x_j addressed to i; dim 0): rank j sends
                                its next s[k] rows to rank k and receives r[k] rows from rank k
    broadcast(x, src, g)        every rank gets x_src                            (src: global rank)
    send / recv                 one-way transfer between two global ranks
    exchange(x, peer)           two ranks swap tensors at once (pipeline send-and-receive)
    send_recv(x, dst, src, g)   every rank of g sends to dst and receives from src at once (rings)
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence

import mindspore as ms

from mm_parallel.comm.base import Backend, Pending
from mm_parallel.comm.watchdog import watched
from mm_parallel.topology import Group, get_topology

REDUCE_OPS = ("sum", "avg", "max", "min")
_FLOAT_DTYPES = (ms.float16, ms.bfloat16, ms.float32, ms.float64)

_BACKEND: Optional[Backend] = None


def get_backend() -> Backend:
    """The backend for this device: native on Ascend, emulated elsewhere.

    ``MM_COMM_BACKEND=cpu|native`` overrides the choice (the CPU emulation also runs on Ascend,
    which is how the two are compared there).
    """
    global _BACKEND
    if _BACKEND is None:
        choice = os.environ.get("MM_COMM_BACKEND") or (
            "native" if ms.get_context("device_target") == "Ascend" else "cpu"
        )
        if choice == "native":
            from mm_parallel.comm.native import NativeBackend

            _BACKEND = NativeBackend()
        elif choice == "cpu":
            from mm_parallel.comm.cpu import CpuBackend

            _BACKEND = CpuBackend()
        else:
            raise ValueError(f"MM_COMM_BACKEND={choice!r} is unknown; use 'cpu' or 'native'")
    return _BACKEND


def _group(group: Optional[Group]) -> Group:
    return get_topology().world if group is None else group


def _dim(x, dim: int, what: str) -> int:
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"{what}: dim {dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.ndim


def _divisible(x, dim: int, size: int, what: str):
    if x.shape[dim] % size != 0:
        raise ValueError(
            f"{what}: dimension {dim} of shape {tuple(x.shape)} has length {x.shape[dim]}, "
            f"which does not split into {size} equal parts; pad it to a multiple of {size}"
        )


def _check_op(x, op: str):
    if op not in REDUCE_OPS:
        raise ValueError(f"reduction op {op!r} is unknown; use one of {', '.join(REDUCE_OPS)}")
    if op == "avg" and x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"op='avg' needs a floating dtype, got {x.dtype}; use op='sum' and divide yourself")


def all_reduce(x, group: Optional[Group] = None, op: str = "sum"):
    """op over the group of every member's ``x``; all members get the result."""
    group = _group(group)
    _check_op(x, op)
    if group.size == 1:
        return x
    out = watched("all_reduce", group.ranks, get_backend().all_reduce, x, group, "sum" if op == "avg" else op)
    return out / group.size if op == "avg" else out


def all_gather(x, group: Optional[Group] = None, dim: int = 0):
    """Concatenation along ``dim`` of every member's ``x``, in group-rank order."""
    group = _group(group)
    dim = _dim(x, dim, "all_gather")
    if group.size == 1:
        return x
    return watched("all_gather", group.ranks, get_backend().all_gather, x, group, dim)


def all_gather_start(x, group: Optional[Group] = None, dim: int = 0) -> Pending:
    """`all_gather` begun: its result is the returned `Pending`'s ``wait()``. On a backend with
    asynchronous calls (native: HCCL's async_op) the transfer runs while the caller computes,
    and its output must not be read before the wait; elsewhere it is done at once."""
    group = _group(group)
    dim = _dim(x, dim, "all_gather")
    if group.size == 1:
        return Pending(lambda: x)
    return watched("all_gather", group.ranks, get_backend().all_gather_start, x, group, dim)


def all_gather_bytes(data: bytes, group: Optional[Group] = None) -> List[bytes]:
    """Every member's ``data`` (any length, empty too), in group-rank order: what ranks tell each
    other of what they wrote (file names, hashes, small files) without a shared disk. Two
    gathers: the lengths, then the bytes padded to the longest (uint8)."""
    import numpy as np

    group = _group(group)
    if group.size == 1:
        return [bytes(data)]
    lengths = all_gather(ms.Tensor(np.array([len(data)], np.int64)), group).asnumpy()
    mine = np.zeros((1, max(1, int(lengths.max()))), np.uint8)
    mine[0, :len(data)] = np.frombuffer(bytes(data), np.uint8)
    rows = all_gather(ms.Tensor(mine), group).asnumpy()
    return [rows[i, :int(n)].tobytes() for i, n in enumerate(lengths)]


def reduce_scatter(x, group: Optional[Group] = None, dim: int = 0, op: str = "sum"):
    """Member i gets the i-th of ``group.size`` equal chunks (along ``dim``) of the reduction."""
    group = _group(group)
    dim = _dim(x, dim, "reduce_scatter")
    _check_op(x, op)
    _divisible(x, dim, group.size, "reduce_scatter")
    if group.size == 1:
        return x
    out = watched("reduce_scatter", group.ranks, get_backend().reduce_scatter, x, group, dim,
                  "sum" if op == "avg" else op)
    return out / group.size if op == "avg" else out


def all_to_all(x, group: Optional[Group] = None, scatter_dim: int = 0, gather_dim: int = 0):
    """Member i gets, from every member j in order, chunk i of x_j along ``scatter_dim``,
    concatenated along ``gather_dim``."""
    group = _group(group)
    scatter_dim = _dim(x, scatter_dim, "all_to_all")
    gather_dim = _dim(x, gather_dim, "all_to_all")
    _divisible(x, scatter_dim, group.size, "all_to_all")
    if group.size == 1:
        return x
    return watched("all_to_all", group.ranks, get_backend().all_to_all, x, group, scatter_dim, gather_dim)


def all_to_all_v(x, group: Optional[Group], send_sizes: Sequence[int], recv_sizes: Sequence[int],
                 all_sizes: Optional[Sequence[Sequence[int]]] = None):
    """Variable-size all-to-all along dim 0 (MoE token dispatch): x's rows are cut into pieces of
    ``send_sizes[k]`` rows, piece k going to group rank k; the result stacks the ``recv_sizes[k]``
    rows group rank k addressed here, in group-rank order. Every rank's sizes must agree with its
    peers' (what j sends to i is what i expects from j); a piece may be empty. ``all_sizes``, when
    every rank knows it (``all_sizes[j][k]``: rows j sends to k), spares the CPU backend its
    exchange of sizes."""
    group = _group(group)
    send_sizes, recv_sizes = [int(s) for s in send_sizes], [int(r) for r in recv_sizes]
    if len(send_sizes) != group.size or len(recv_sizes) != group.size or min(send_sizes + recv_sizes) < 0:
        raise ValueError(f"all_to_all_v: need {group.size} non-negative send and receive sizes, "
                         f"got {send_sizes} and {recv_sizes}")
    if sum(send_sizes) != x.shape[0]:
        raise ValueError(f"all_to_all_v: send sizes {send_sizes} add up to {sum(send_sizes)} rows, "
                         f"x has {x.shape[0]}")
    if all_sizes is not None:
        all_sizes = [[int(v) for v in row] for row in all_sizes]
        if all_sizes[group.rank] != send_sizes or [row[group.rank] for row in all_sizes] != recv_sizes:
            raise ValueError(f"all_to_all_v: all_sizes {all_sizes} disagree with this rank's send sizes "
                             f"{send_sizes} / receive sizes {recv_sizes}")
    if group.size == 1:
        return x
    return watched("all_to_all_v", group.ranks, get_backend().all_to_all_v, x, group, send_sizes, recv_sizes,
                   all_sizes)


def broadcast(x, src: int, group: Optional[Group] = None):
    """Every member gets the ``x`` of global rank ``src`` (``x`` elsewhere gives shape and dtype)."""
    group = _group(group)
    group.group_rank_of(src)
    if group.size == 1:
        return x
    return watched("broadcast", group.ranks, get_backend().broadcast, x, src, group)


def barrier(group: Optional[Group] = None):
    """Return once every member has arrived."""
    group = _group(group)
    if group.size > 1:
        watched("barrier", group.ranks, get_backend().barrier, group)


def _me() -> int:
    return get_topology().rank


def send(x, dst: int):
    """Send ``x`` to global rank ``dst``, which must call ``recv`` with the same shape and dtype."""
    me = _me()
    watched("send", sorted((me, dst)), get_backend().send, x, dst, me)


def recv(shape: Sequence[int], dtype, src: int):
    """Receive from global rank ``src`` the tensor it passes to ``send``."""
    me = _me()
    return watched("recv", sorted((me, src)), get_backend().recv, tuple(shape), dtype, src, me)


def exchange(x, peer: int, recv_shape: Optional[Sequence[int]] = None):
    """Send ``x`` to ``peer`` and receive ``peer``'s tensor (shape ``recv_shape``, default x's) at once.

    Both sides call it together; the two tensors may differ in shape but not in dtype.
    """
    recv_shape = tuple(x.shape if recv_shape is None else recv_shape)
    me = _me()
    return watched("exchange", sorted((me, peer)), get_backend().exchange, x, peer, me, recv_shape)


def send_recv(x, dst: int, src: int, group: Group, recv_shape: Optional[Sequence[int]] = None):
    """Every member of ``group`` at once sends ``x`` to ``dst`` and receives from ``src``
    (global ranks): a ring shift when dst = next and src = previous."""
    group.group_rank_of(dst)
    group.group_rank_of(src)
    recv_shape = tuple(x.shape if recv_shape is None else recv_shape)
    if group.size == 1:
        return x
    return watched("send_recv", group.ranks, get_backend().send_recv, x, dst, src, group, recv_shape)


def ring_shift(x, group: Group, offset: int = 1):
    """Member i receives the ``x`` of member (i - offset) mod n: K/V passing in ring attention."""
    if group.size == 1 or offset % group.size == 0:
        return x
    return watched("ring_shift", group.ranks, get_backend().ring_shift, x, group, offset)


__all__ = [
    "REDUCE_OPS",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "all_to_all_v",
    "barrier",
    "broadcast",
    "exchange",
    "get_backend",
    "recv",
    "ring_shift",
    "send",
    "send_recv",
]
