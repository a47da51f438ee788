"""Differentiable communication regions (after Megatron-Core's ``mappings.py``).

Each region is a pair: a forward collective and the backward that makes the gradient right.
Notation: group of n ranks, rank i holds x_i; ``chunk_i(t, d)`` is the i-th of n equal pieces of
t along d; ``cat(.., d)`` concatenates in group-rank order.

    region                       forward                          backward (dL/dx_i from dL/dy)
    copy_to_region               y_i = x                          sum_j dy_j              (all-reduce)
    reduce_from_region           y = sum_j x_j                    dy                      (identity)
    scatter_to_region            y_i = chunk_i(x, d)              cat_j(dy_j, d)          (all-gather)
    gather_from_region           y = cat_j(x_j, d)                chunk_i(dy, d)          (split)
    scatter_to_sequence          y_i = chunk_i(x, d)              cat_j(dy_j, d)          (all-gather)
    gather_from_sequence         y = cat_j(x_j, d)                chunk_i(sum_j dy_j, d)  (reduce-scatter)
                                                                  or chunk_i(dy, d) when the consumer
                                                                  is replicated (grad_reduce_scatter=False)
    reduce_scatter_to_sequence   y_i = chunk_i(sum_j x_j, d)      cat_j(dy_j, d)          (all-gather)
    all_to_all                   y_i = cat_j(chunk_i(x_j, s), g)  the inverse all-to-all  (g <-> s)
    ring_shift                   y_i = x_{i-k}                    dy shifted back: dx_i = dy_{i+k}
    all_to_all_v                 y_i = cat_j(rows x_j sends to i) the inverse all-to-all  (sizes swapped)
                                 (MoE token dispatch; sizes per peer, known on the host)

Tensor-parallel regions default to the last dim (hidden / heads); sequence regions to dim 1,
the sequence dim of the batch-first (batch, seq, ...) layout used by every model here.
A group of size one makes every region the identity.
"""

from __future__ import annotations

from typing import Optional

from mindspore import nn

from mm_parallel import comm
from mm_parallel.comm.base import chunk
from mm_parallel.ops.device import with_zero_row
from mm_parallel.topology import Group, get_topology


class _Region(nn.Cell):
    """A communication region: ``forward`` in construct, ``backward`` in bprop."""

    def __init__(self, group: Group, **dims):
        super().__init__()
        self.group = group
        self.dims = dims

    def construct(self, x):
        return self.forward(x)

    def bprop(self, x, out, dout):
        return (self.backward(dout),)


class _CopyToRegion(_Region):
    def forward(self, x):
        return x

    def backward(self, dy):
        return comm.all_reduce(dy, self.group)


class _ReduceFromRegion(_Region):
    def forward(self, x):
        return comm.all_reduce(x, self.group)

    def backward(self, dy):
        return dy


class _ScatterToRegion(_Region):
    def forward(self, x):
        _check_divisible(x, self.dims["dim"], self.group)
        return chunk(x, self.group.size, self.group.rank, self.dims["dim"])

    def backward(self, dy):
        return comm.all_gather(dy, self.group, self.dims["dim"])


class _GatherFromRegion(_Region):
    def forward(self, x):
        return comm.all_gather(x, self.group, self.dims["dim"])

    def backward(self, dy):
        return chunk(dy, self.group.size, self.group.rank, self.dims["dim"])


class _GatherFromSequence(_Region):
    def forward(self, x):
        return comm.all_gather(x, self.group, self.dims["dim"])

    def backward(self, dy):
        if self.dims["grad_reduce_scatter"]:
            return comm.reduce_scatter(dy, self.group, self.dims["dim"])
        return chunk(dy, self.group.size, self.group.rank, self.dims["dim"])


class _ReduceScatterToSequence(_Region):
    def forward(self, x):
        return comm.reduce_scatter(x, self.group, self.dims["dim"])

    def backward(self, dy):
        return comm.all_gather(dy, self.group, self.dims["dim"])


class _AllToAll(_Region):
    def forward(self, x):
        return comm.all_to_all(x, self.group, self.dims["scatter_dim"], self.dims["gather_dim"])

    def backward(self, dy):
        return comm.all_to_all(dy, self.group, self.dims["gather_dim"], self.dims["scatter_dim"])


class _RingShift(_Region):
    def forward(self, x):
        return comm.ring_shift(x, self.group, self.dims["offset"])

    def backward(self, dy):
        return comm.ring_shift(dy, self.group, -self.dims["offset"])


class _AllToAllV(_Region):
    """Rows with a trailing placeholder: x has sum(send) + 1 rows, y sum(recv) + 1, the last row
    zeros and never sent. MindSpore's autodiff fails on empty tensors (measured: the gradient of a
    gather with no rows), and a rank may send or receive no token; the placeholder keeps every
    tensor the model differentiates non-empty."""

    def forward(self, x):
        rows = comm.all_to_all_v(x[:-1], self.group, self.dims["send"], self.dims["recv"], self.dims["sizes"])
        return with_zero_row(rows, x)

    def backward(self, dy):
        sizes = self.dims["sizes"]
        back = None if sizes is None else [list(column) for column in zip(*sizes)]  # j -> k becomes k -> j
        return with_zero_row(comm.all_to_all_v(dy[:-1], self.group, self.dims["recv"], self.dims["send"], back), dy)


def _check_divisible(x, dim, group):
    if x.shape[dim] % group.size != 0:
        raise ValueError(
            f"cannot split dimension {dim} of shape {tuple(x.shape)} into {group.size} equal parts; "
            f"pad it to a multiple of {group.size}"
        )


def _tp(group: Optional[Group]) -> Group:
    return get_topology().tp if group is None else group


def _apply(region_cls, x, group: Group, **dims):
    if group.size == 1:
        return x
    return region_cls(group, **dims)(x)


def copy_to_region(x, group: Optional[Group] = None):
    """Forward identity, backward all-reduce (entering a tensor-parallel region). Default group: tp."""
    return _apply(_CopyToRegion, x, _tp(group))


def reduce_from_region(x, group: Optional[Group] = None):
    """Forward all-reduce (sum), backward identity (leaving a row-parallel region). Default group: tp."""
    return _apply(_ReduceFromRegion, x, _tp(group))


def scatter_to_region(x, group: Optional[Group] = None, dim: int = -1):
    """Forward keep this rank's chunk along ``dim``, backward all-gather along ``dim``."""
    return _apply(_ScatterToRegion, x, _tp(group), dim=dim % x.ndim)


def gather_from_region(x, group: Optional[Group] = None, dim: int = -1):
    """Forward all-gather along ``dim``, backward keep this rank's chunk."""
    return _apply(_GatherFromRegion, x, _tp(group), dim=dim % x.ndim)


def scatter_to_sequence(x, group: Optional[Group] = None, dim: int = 1):
    """Forward keep this rank's chunk of the sequence, backward all-gather it."""
    return _apply(_ScatterToRegion, x, _tp(group), dim=dim % x.ndim)


def gather_from_sequence(x, group: Optional[Group] = None, dim: int = 1, grad_reduce_scatter: bool = True):
    """Forward all-gather the sequence; backward reduce-scatter it (the consumer is tensor parallel,
    so each rank's gradient is a partial sum) or, with ``grad_reduce_scatter=False``, split it."""
    return _apply(_GatherFromSequence, x, _tp(group), dim=dim % x.ndim, grad_reduce_scatter=grad_reduce_scatter)


def reduce_scatter_to_sequence(x, group: Optional[Group] = None, dim: int = 1):
    """Forward reduce-scatter along the sequence, backward all-gather it."""
    return _apply(_ReduceScatterToSequence, x, _tp(group), dim=dim % x.ndim)


def all_to_all(x, group: Group, scatter_dim: int, gather_dim: int):
    """Forward all-to-all (split ``scatter_dim``, concatenate ``gather_dim``), backward the inverse.

    Ulysses uses it to trade a sharded sequence for sharded heads and back.
    """
    return _apply(_AllToAll, x, group, scatter_dim=scatter_dim % x.ndim, gather_dim=gather_dim % x.ndim)


def all_to_all_v(x, group: Group, send_sizes, recv_sizes, all_sizes=None):
    """Forward: rank i sends its next ``send_sizes[k]`` rows to rank k and stacks the
    ``recv_sizes[k]`` rows each rank k sends it; backward: the same exchange with the sizes swapped.
    ``x`` carries one trailing placeholder row (not sent); so does the result (zeros).
    ``all_sizes`` (every rank's send sizes, when all know them) saves the CPU backend a collective."""
    if group.size == 1:
        return x
    sizes = None if all_sizes is None else tuple(tuple(int(v) for v in row) for row in all_sizes)
    return _AllToAllV(group, send=tuple(int(s) for s in send_sizes), recv=tuple(int(r) for r in recv_sizes),
                      sizes=sizes)(x)


def ring_shift(x, group: Group, offset: int = 1):
    """Forward: rank i gets x of rank i - offset (ring order of the group); backward: the inverse shift.

    Ring attention passes key/value blocks with it."""
    return _apply(_RingShift, x, group, offset=offset)


__all__ = [
    "all_to_all",
    "all_to_all_v",
    "copy_to_region",
    "gather_from_region",
    "gather_from_sequence",
    "reduce_from_region",
    "reduce_scatter_to_sequence",
    "ring_shift",
    "scatter_to_region",
    "scatter_to_sequence",
]
