"""CPU backend (mccl): the collectives mccl has, and the ones it lacks built from them.

Measured on MindSpore 2.7.2 CPU (DESIGN §4): ``all_reduce``, ``all_gather`` (list form) and
``broadcast`` work on the world and on sub-groups; ``reduce_scatter``, ``all_to_all``,
``send``/``recv`` and ``batch_isend_irecv`` do not. So:

    reduce_scatter(x)  = the group-rank-th chunk of all_reduce(x)
    all_to_all(x)      = small: all_gather(x), keep the chunks addressed here; large (or n = 2):
                         n-1 round-robin rounds, each swapping the addressed chunk with one partner
    all_to_all_v(x)    = n = 2: one exchange of the two pieces; else all_gather the send sizes (unless
                         the caller knows them all), then small: every rank's rows padded to the
                         longest in one all_gather, keep the pieces addressed here; large: the
                         pairwise rounds of all_to_all with pieces of any size
    send / recv        = broadcast inside the two-rank group {sender, receiver}
    exchange(x, peer)  = all_gather inside the two-rank group {me, peer}
    ring_shift(x)      = one-way broadcasts in two-rank groups, 2-3 rounds of disjoint pairs
    send_recv (any)    = all_gather over the group, keep the source's piece

Dtypes mccl refuses (measured): all_reduce has no float64, uint8, bool; all_gather and
broadcast have no int16, bool, bfloat16. A refused dtype travels as a lossless carrier dtype, and
a reduction mccl cannot do is an all_gather followed by a local reduction. mccl's all_reduce and
broadcast of int32 / int64 go through float32 (measured: 2^24 + 1 arrives as 2^24, 2^31 - 1 as
-2^31), while all_gather moves them exactly; so integers of 32 and 64 bits are reduced and
broadcast by way of all_gather (one collective either way). Errors from mccl
surface asynchronously (at the next sync), so dtypes are checked here before the call.
all_gather and broadcast send tensors over 4 MB in pieces: larger single messages fail.
``barrier`` is a waited-for one-element all_reduce: mccl's own barrier breaks a following large
broadcast.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from mm_parallel.comm.base import Backend, chunk
from mm_parallel.comm.schedules import round_robin, shift_rounds
from mm_parallel.ops.device import zeros

_REDUCE_DTYPES = {ms.float32, ms.float16, ms.bfloat16, ms.int8, ms.int16}  # exact in mccl's float32 path
_WIDE_INTEGERS = {ms.int32, ms.int64}  # all_reduce / broadcast round them through float32: gathered instead
_MOVE_DTYPES = {ms.float32, ms.float16, ms.float64, ms.int8, ms.uint8, ms.int32, ms.int64}
# Lossless stand-ins for dtypes that all_gather / broadcast refuse.
_MOVE_CARRIER = {ms.bool_: ms.int8, ms.int16: ms.int32, ms.bfloat16: ms.float32}


# mccl's all_gather and broadcast of one message over ~8 MB fail (the source times out after
# 30 s, "CollectiveWait failed") once ranks reach the call at different moments; measured: 16 MB
# fails within 5-8 calls with one rank 0.5 s late, 8 MB passes 14. Larger tensors travel in pieces.
_MAX_MESSAGE_BYTES = 4 << 20
# Above this, all_to_all over more than two ranks goes pairwise (bandwidth-bound); below, one
# all_gather (latency-bound). Measured on 4 processes: at 16 MB pairwise is 0.64x all_reduce vs
# 2.2x by all_gather; at 4 KB-1 MB the n-1 rounds of latency cost more than the bytes saved.
_PAIRWISE_ALL_TO_ALL_BYTES = 4 << 20


def _pieces(x) -> List:
    """``x`` flattened and cut into messages of at most _MAX_MESSAGE_BYTES (one piece if small)."""
    per_piece = max(1, _MAX_MESSAGE_BYTES // x.itemsize)
    if x.size <= per_piece:
        return [x.contiguous()]
    flat = x.reshape(-1)
    return [flat[i : i + per_piece].contiguous() for i in range(0, x.size, per_piece)]


def _joined(pieces: List, shape) -> object:
    return pieces[0].reshape(shape) if len(pieces) == 1 else ops.concat(pieces, 0).reshape(shape)


def _carried(x):
    """(x in a dtype mccl moves, the dtype to cast back to)."""
    if x.dtype in _MOVE_DTYPES:
        return x, x.dtype
    if x.dtype in _MOVE_CARRIER:
        return x.astype(_MOVE_CARRIER[x.dtype]), x.dtype
    raise TypeError(f"dtype {x.dtype} cannot be communicated on CPU; cast to one of float32, float16, int32, int64")


_LOCAL_REDUCE = {"sum": lambda s: s.sum(0), "max": lambda s: ops.amax(s, 0), "min": lambda s: ops.amin(s, 0)}


class CpuBackend(Backend):
    name = "mccl"

    def all_reduce(self, x, group, op):
        if x.dtype not in _REDUCE_DTYPES:
            return self._all_reduce_by_gather(x, group, op)
        import mindspore.mint.distributed as dist

        out = x.copy()
        dist.all_reduce(out, op=op, group=self.group_name(group))
        return out

    def _all_reduce_by_gather(self, x, group, op):
        parts = self._gather_list(x.reshape((1,) + x.shape), group)
        if x.dtype == ms.bool_:
            # bool sum / max = any, min = all: reduce as int8 and compare.
            stacked = ops.concat([p.astype(ms.int8) for p in parts], 0)
            return _LOCAL_REDUCE[op](stacked) != 0
        stacked = ops.concat(parts, 0)
        return _LOCAL_REDUCE[op](stacked).astype(x.dtype)

    def _gather_list(self, x, group) -> List:
        """[x of group rank 0, x of group rank 1, ...]"""
        import mindspore.mint.distributed as dist

        moved, dtype = _carried(x)
        pieces = _pieces(moved)
        gathered = [[ops.zeros(p.shape, p.dtype) for _ in range(group.size)] for p in pieces]
        for piece, out in zip(pieces, gathered):
            dist.all_gather(out, piece, group=self.group_name(group))
        parts = [_joined([g[r] for g in gathered], moved.shape) for r in range(group.size)]
        return parts if moved.dtype == dtype else [p.astype(dtype) for p in parts]

    def all_gather(self, x, group, dim):
        return ops.concat(self._gather_list(x, group), dim)

    def reduce_scatter(self, x, group, dim, op):
        # a copy: the chunk of the whole reduction would keep all of it alive (native returns 1/n)
        return chunk(self.all_reduce(x, group, op), group.size, group.rank, dim).copy()

    def all_to_all(self, x, group, scatter_dim, gather_dim):
        n, me = group.size, group.rank
        if n > 2 and x.nbytes < _PAIRWISE_ALL_TO_ALL_BYTES:
            # Latency-bound: one all_gather beats n-1 rounds of exchanges.
            parts = self._gather_list(x, group)
            return ops.concat([chunk(p, n, me, scatter_dim) for p in parts], gather_dim)
        # Pairwise: in each round-robin round, swap with one partner just the chunk addressed to
        # it. Each rank sends (n-1)/n of x in n-1 two-rank exchanges; an all_gather would move n x.
        pieces = [chunk(x, n, j, scatter_dim) for j in range(n)]
        received = list(pieces)
        for partners in round_robin(n):
            j = partners[me]
            if j is not None:
                received[j] = self._swap(pieces[j].contiguous(), self.pair(group.global_rank, group.ranks[j]),
                                         group.ranks[j], pieces[j].shape)
        return ops.concat([received[j] for j in range(n)], gather_dim)

    def all_to_all_v(self, x, group, send_sizes, recv_sizes, all_sizes=None):
        n, me, row = group.size, group.rank, tuple(x.shape[1:])
        offsets = [sum(send_sizes[:k]) for k in range(n + 1)]  # Python ints: Tensor slices refuse numpy ints
        pieces = [x[offsets[k]:offsets[k + 1]] for k in range(n)]
        received = [None] * n
        received[me] = pieces[me]
        if n > 2:
            if all_sizes is None:
                all_sizes = [s.asnumpy() for s in self._gather_list(Tensor(np.asarray(send_sizes, np.int32)), group)]
            sizes = np.asarray(all_sizes, np.int64)  # sizes[j, k]: rows j sends to k
            width = int(sizes.sum(1).max())
            if width == 0:
                return zeros((0,) + row, x.dtype)
            if width * _numel(row) * x.itemsize < _PAIRWISE_ALL_TO_ALL_BYTES:
                return self._all_to_all_v_gathered(x, group, sizes, width, row)
        # two ranks, or large pieces: in each round-robin round swap with one partner the piece for it
        for partners in round_robin(n) if n > 2 else [[1, 0]]:
            j = partners[me]
            if j is not None and (send_sizes[j] or recv_sizes[j]):
                received[j] = self._swap(pieces[j], self.pair(group.global_rank, group.ranks[j]), group.ranks[j],
                                         (recv_sizes[j],) + row)
        return _stacked([p for p in received if p is not None], row, x.dtype)

    def _all_to_all_v_gathered(self, x, group, sizes, width: int, row):
        """Small pieces: every rank's rows padded to the longest, one all_gather, keep the pieces for me."""
        me = group.rank
        flat = x.reshape(-1)
        if x.shape[0] < width:
            flat = ops.concat([flat, zeros(((width - x.shape[0]) * _numel(row),), x.dtype)])
        received = []
        for j, part in enumerate(self._gather_list(flat, group)):
            start = int(sizes[j, :me].sum())
            received.append(part.reshape((width,) + row)[start:start + int(sizes[j, me])])
        return _stacked(received, row, x.dtype)

    def broadcast(self, x, src, group):
        import mindspore.mint.distributed as dist

        if x.dtype in _WIDE_INTEGERS:  # exact through all_gather, not through broadcast (docstring)
            return self._gather_list(x, group)[group.group_rank_of(src)]
        moved, dtype = _carried(x)
        pieces = [p.copy() for p in _pieces(moved)]
        for piece in pieces:
            dist.broadcast(piece, src=src, group=self.group_name(group))
        out = _joined(pieces, moved.shape)
        return out if out.dtype == dtype else out.astype(dtype)

    def barrier(self, group):
        # mccl's own barrier followed by a large broadcast makes the broadcast's source fail
        # ("CollectiveWait failed" after 30 s; measured with 16 MB): a one-element all-reduce,
        # waited for, is the same rendezvous without that fault.
        self.all_reduce(ops.ones((1,), ms.float32), group, "sum").asnumpy()

    # Point-to-point: every transfer is a collective of a group that the two ends share.
    def send(self, x, dst, me):
        self.broadcast(x, me, self.pair(me, dst))

    def recv(self, shape, dtype, src, me):
        return self.broadcast(zeros(shape, dtype), src, self.pair(me, src))

    def exchange(self, x, peer, me, recv_shape):
        return self._swap(x, self.pair(me, peer), peer, recv_shape)

    def send_recv(self, x, dst, src, group, recv_shape):
        if dst == src:
            return self.exchange(x, dst, group.global_rank, recv_shape)
        return self._swap(x, group, src, recv_shape)

    def ring_shift(self, x, group, offset):
        me, n = group.rank, group.size
        if (2 * offset) % n == 0:  # the next rank is also the previous one: a two-way swap
            return self.exchange(x, group.ranks[(me + offset) % n], group.global_rank, x.shape)
        # One-way broadcasts inside two-rank groups, in rounds of disjoint pairs: each rank sends
        # x once and receives once (an all_gather over the ring would move n times x).
        out = x
        for transfers in shift_rounds(group.size, offset):
            to, frm = transfers[me]
            if to is not None:
                self.send(x, group.ranks[to], group.global_rank)
            if frm is not None:
                out = self.recv(x.shape, x.dtype, group.ranks[frm], group.global_rank)
        return out

    def _swap(self, x, group, src, recv_shape: Tuple[int, ...]):
        """Everyone in ``group`` contributes ``x``; return the piece of global rank ``src``.

        Pieces may differ in shape between ranks (pipeline micro-batches of varying length), so
        each travels flattened and padded to the largest size: this side knows its own size and,
        from ``recv_shape``, the source's; every pair in a two-rank group agrees on both.
        """
        if tuple(recv_shape) == tuple(x.shape):
            return self._gather_list(x, group)[group.group_rank_of(src)]
        if group.size > 2:
            raise ValueError("a ring send_recv over more than two ranks needs equal shapes on every rank")
        numel, recv_numel = x.size, _numel(recv_shape)
        width = max(numel, recv_numel)
        flat = x.reshape(-1)
        if width > numel:
            flat = ops.concat([flat, zeros((width - numel,), x.dtype)])
        parts = self._gather_list(flat, group)
        return parts[group.group_rank_of(src)][:recv_numel].reshape(tuple(recv_shape))


def _stacked(pieces, row, dtype):
    """The non-empty pieces concatenated along dim 0 (zero rows if none)."""
    pieces = [p for p in pieces if p.shape[0]]
    if not pieces:
        return zeros((0,) + tuple(row), dtype)
    return pieces[0] if len(pieces) == 1 else ops.concat(pieces, 0)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
