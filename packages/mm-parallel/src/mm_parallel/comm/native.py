"""Native backend (Ascend, HCCL): every collective is the library's own.

HCCL's tensor collectives work on dimension 0 of a contiguous tensor, so other dimensions are
moved to the front and back. MindSpore's CPU collectives lack these calls; on CPU the backend
runs against documented-semantics stand-ins of them (mm_parallel.testing.hccl), and the CPU
backend is the reference its results are compared with.
"""

from __future__ import annotations

import mindspore as ms
from mindspore import ops

from mm_parallel.comm.base import Backend, Pending


def _buffer(shape, dtype):
    """An output buffer the collective overwrites. bfloat16 ones are cast from float32 zeros:
    MindSpore's CPU (where this backend runs on its stand-ins) has no bf16 Zeros kernel; on
    Ascend the cast is one small elementwise op next to the transfer."""
    if dtype == ms.bfloat16:
        return ops.zeros(tuple(shape), ms.float32).astype(dtype)
    return ops.zeros(tuple(shape), dtype)


def _copied(x):
    """A copy of x for an in-place collective: written with copy_, since MindSpore 2.7.2's
    Tensor.copy() on CPU rounds int32 through float32 (2^31 - 1 came back as -2^31)."""
    out = _buffer(x.shape, x.dtype)
    out.copy_(x)
    return out


def _to_front(x, dim):
    return x if dim == 0 else ops.moveaxis(x, dim, 0).contiguous()


def _from_front(x, dim):
    return x if dim == 0 else ops.moveaxis(x, 0, dim).contiguous()


class NativeBackend(Backend):
    """``calls``: the module (or namespace) whose functions are called, mindspore.mint.distributed
    unless given (mm_parallel.testing passes its stand-ins)."""

    name = "hccl"
    asynchronous = True

    def __init__(self, calls=None):
        super().__init__()
        if calls is None:
            import mindspore.mint.distributed as calls
        self.dist = calls

    def new_group(self, dist, ranks):
        return self.dist.new_group(ranks, backend=self.name)

    def all_reduce(self, x, group, op):
        dist = self.dist
        out = _copied(x)
        dist.all_reduce(out, op=op, group=self.group_name(group))
        return out

    def all_gather(self, x, group, dim):
        out, _, _ = self._gather_into(x, group, dim, async_op=False)
        return _from_front(out, dim)

    def all_gather_start(self, x, group, dim) -> Pending:
        """The gather as an asynchronous HCCL call (async_op=True): it runs on the device while
        the caller goes on; the output is read only after the handle's wait."""
        out, handle, sent = self._gather_into(x, group, dim, async_op=True)

        def finish(sent=sent):  # the send buffer kept alive until then: HCCL reads it meanwhile
            handle.wait()
            return _from_front(out, dim)

        return Pending(finish)

    def _gather_into(self, x, group, dim, async_op: bool):
        """(the output buffer, HCCL's handle or None, the send buffer) of all_gather_into_tensor
        on x with ``dim`` moved to the front."""
        front = _to_front(x, dim)
        out = _buffer((front.shape[0] * group.size,) + front.shape[1:], x.dtype)
        handle = self.dist.all_gather_into_tensor(out, front, group=self.group_name(group), async_op=async_op)
        return out, handle, front

    def reduce_scatter(self, x, group, dim, op):
        dist = self.dist
        front = _to_front(x, dim)
        out = _buffer((front.shape[0] // group.size,) + front.shape[1:], x.dtype)
        dist.reduce_scatter_tensor(out, front, op=op, group=self.group_name(group))
        return _from_front(out, dim)

    def all_to_all(self, x, group, scatter_dim, gather_dim):
        dist = self.dist
        # all_to_all_single sends the i-th dim-0 chunk to rank i and stacks what arrives on dim 0.
        front = _to_front(x, scatter_dim)
        out = _buffer(front.shape, x.dtype)
        dist.all_to_all_single(out, front, group=self.group_name(group))
        pieces = ops.split(_from_front(out, scatter_dim), x.shape[scatter_dim] // group.size, scatter_dim)
        return ops.concat(pieces, gather_dim)

    def all_to_all_v(self, x, group, send_sizes, recv_sizes, all_sizes=None):
        dist = self.dist
        out = _buffer((sum(recv_sizes),) + tuple(x.shape[1:]), x.dtype)
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=list(recv_sizes),
                               input_split_sizes=list(send_sizes), group=self.group_name(group))
        return out

    def broadcast(self, x, src, group):
        dist = self.dist
        out = _copied(x)
        dist.broadcast(out, src=src, group=self.group_name(group))
        return out

    def barrier(self, group):
        dist = self.dist
        dist.barrier(group=self.group_name(group))

    def send(self, x, dst, me):
        dist = self.dist
        dist.send(x.contiguous(), dst=dst)

    def recv(self, shape, dtype, src, me):
        dist = self.dist
        out = _buffer(shape, dtype)
        dist.recv(out, src=src)
        return out

    def exchange(self, x, peer, me, recv_shape):
        return self._isend_irecv(x, peer, peer, recv_shape, None)

    def send_recv(self, x, dst, src, group, recv_shape):
        return self._isend_irecv(x, dst, src, recv_shape, group)

    def ring_shift(self, x, group, offset):
        n, me = group.size, group.rank
        return self._isend_irecv(x, group.ranks[(me + offset) % n], group.ranks[(me - offset) % n], x.shape, group)

    def _isend_irecv(self, x, dst, src, recv_shape, group):
        """One isend and one irecv in a batch; peers are global ranks, ``group`` (None: the world)
        the communicator every P2POp of the batch must share."""
        dist = self.dist
        out = _buffer(tuple(recv_shape), x.dtype)
        name = None if group is None else self.group_name(group)
        ops_list = [dist.P2POp(dist.isend, x.contiguous(), dst, name), dist.P2POp(dist.irecv, out, src, name)]
        for work in dist.batch_isend_irecv(ops_list):
            work.wait()
        return out

