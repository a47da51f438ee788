"""Token dispatchers: move each routed token to the rank holding its expert and its output back.

Notation: P ranks in the ep group, E experts, E_l = E / P per rank (rank p holds [p E_l, (p+1) E_l)),
rank i routes T_i tokens, slot (t, j) goes to expert e[t, j] with weight w[t, j].

AllToAllDispatcher (dropless; Megatron's "alltoall"):
    counts     c_i[e] = slots of rank i for expert e; all-gathered, so every rank knows C[i, e] (and
               so every exchange's sizes: no further size exchange)
    dispatch   rank i sends its slots sorted by expert: sum_{e of rank p} c_i[e] rows to rank p
               (mappings.all_to_all_v; backward: the same exchange reversed)
    experts    rank p stacks the rows for its experts from every source and groups them by expert
    combine    outputs go back by the reverse exchange; y_t = sum_j w[t, j] out[t, j]
With ``pad_to_capacity`` every expert receives exactly C rows from every rank: no count exchange.

AllGatherDispatcher (small ep; Megatron's "allgather"):
    dispatch   X = cat_i(x_i) and W = cat_i(w_i) all-gathered over ep (backward: reduce-scatter,
               since each rank's gradient covers only its experts' share); every rank picks the
               slots routed to its experts
    combine    Y_g = sum over this rank's slots of token g of w out; y_i = chunk_i(sum_p Y^p)
               (reduce-scatter; backward all-gather)
Ranks with fewer tokens pad to the group's largest T (one small all-gather of T).

Dropped slots (capacity) are not sent; their output is the zero row, so they add nothing.
Every token buffer ends in one zero row (see mappings.all_to_all_v): padding and dropped slots
point there, and no tensor the model differentiates is empty.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
from mindspore import Tensor, ops

from mm_parallel import comm, mappings
from mm_parallel.moe.router import Routing
from mm_parallel.moe.token_layout import ExpertGroups, expert_groups, received_experts, send_layout
from mm_parallel.ops.device import with_zero_row, zeros
from mm_parallel.topology import Topology

_bmm = ops.BatchMatMul()


def _index(array) -> Tensor:
    return Tensor(np.ascontiguousarray(array).astype(np.int32))


def weighted_sum(outputs, rows: np.ndarray, weights):
    """y_t = sum_j weights[t, j] outputs[rows[t, j]] as one batched matmul (T, 1, k) x (T, k, H)."""
    tokens, k = rows.shape
    picked = ops.gather(outputs, _index(rows.reshape(-1)), 0).reshape(tokens, k, outputs.shape[-1])
    return _bmm(weights.astype(picked.dtype).reshape(tokens, 1, k), picked).reshape(tokens, -1)


class _Dispatcher:
    """The ep group and this rank's experts; ``dispatch(x, routing, pad_to)`` -> (expert input
    buffer (N + 1, H), its `ExpertGroups`, state), ``combine(expert_out, state)`` -> (T, H)."""

    def __init__(self, num_experts: int, topology: Topology):
        self.num_experts, self.group = num_experts, topology.ep
        self.local = num_experts // self.group.size


@dataclass
class _Sent:
    """What an all-to-all combine needs from its dispatch."""

    row_of_slot: np.ndarray
    sizes: np.ndarray  # sizes[j, k]: rows rank j sent to rank k
    groups: ExpertGroups
    weights: Tensor


class AllToAllDispatcher(_Dispatcher):
    """See the module docstring."""

    def dispatch(self, x, routing: Routing, pad_to: Optional[int] = None):
        """-> (expert input buffer (N + 1, H), its `ExpertGroups`, state for `combine`)."""
        tokens = x.shape[0]
        layout = send_layout(routing.experts, routing.keep, self.num_experts, pad_to)
        p, local = self.group.size, self.local
        if pad_to is not None or p == 1:
            counts = np.tile(layout.counts, (p, 1))
        else:
            gathered = comm.all_gather(Tensor(layout.counts.astype(np.int32)), self.group)
            counts = gathered.asnumpy().reshape(p, self.num_experts)
        sizes = counts.reshape(p, p, local).sum(2)  # sizes[j, k]: rows rank j sends to rank k
        send_sizes, recv_sizes = sizes[self.group.rank].tolist(), sizes[:, self.group.rank].tolist()
        rows = np.where(layout.tokens < 0, tokens, layout.tokens)
        sent = ops.gather(with_zero_row(x), _index(np.append(rows, tokens)), 0)
        received = mappings.all_to_all_v(sent, self.group, send_sizes, recv_sizes, sizes)
        experts = np.append(received_experts(counts, self.group.rank, local), -1)  # the zero row: no expert
        groups = expert_groups(experts, local, sink=len(experts) - 1)
        return received, groups, _Sent(layout.row_of_slot, sizes, groups, routing.weights)

    def combine(self, expert_out, state: _Sent):
        """(T, H): every token's weighted sum of its experts' outputs."""
        back = ops.gather(expert_out, _index(state.groups.slot), 0)
        me, back_sizes = self.group.rank, state.sizes.T  # the way back: k returns to j what j sent k
        returned = mappings.all_to_all_v(back, self.group, back_sizes[me].tolist(), back_sizes[:, me].tolist(),
                                         back_sizes)
        sink = returned.shape[0] - 1
        return weighted_sum(returned, np.where(state.row_of_slot < 0, sink, state.row_of_slot), state.weights)


@dataclass
class _Gathered:
    """What an all-gather combine needs from its dispatch."""

    tokens: int
    slot_of_slots: np.ndarray
    weights: Tensor


class AllGatherDispatcher(_Dispatcher):
    """See the module docstring."""

    def dispatch(self, x, routing: Routing, pad_to: Optional[int] = None):
        tokens, k = routing.experts.shape
        experts = routing.experts if routing.keep is None else np.where(routing.keep, routing.experts, -1)
        width = tokens
        if self.group.size > 1:
            width = int(comm.all_gather(Tensor(np.array([tokens], np.int32)), self.group).asnumpy().max())
        pad = width - tokens
        weights = routing.weights
        if pad:
            x = ops.concat([x, zeros((pad, x.shape[1]), x.dtype)], 0)
            weights = ops.concat([weights, zeros((pad, k), weights.dtype)], 0)
            experts = np.concatenate([experts, np.full((pad, k), -1, experts.dtype)])
        if self.group.size > 1:
            x = mappings.gather_from_sequence(x, self.group, 0)
            weights = mappings.gather_from_sequence(weights, self.group, 0)
            experts = comm.all_gather(Tensor(experts.astype(np.int32)), self.group).asnumpy().astype(np.int64)
        first = self.group.rank * self.local
        mine = np.where((experts >= first) & (experts < first + self.local), experts - first, -1).reshape(-1)
        groups = expert_groups(mine, self.local, sink=mine.size)
        sink_row = x.shape[0]  # the zero row appended to the gathered tokens
        rows = replace(groups, padded=np.where(groups.padded == mine.size, sink_row, groups.padded // k))
        return with_zero_row(x), rows, _Gathered(tokens, groups.slot.reshape(-1, k), weights)

    def combine(self, expert_out, state: _Gathered):
        y = weighted_sum(expert_out, state.slot_of_slots, state.weights)
        if self.group.size > 1:
            y = mappings.reduce_scatter_to_sequence(y, self.group, 0)
        return y[:state.tokens] if y.shape[0] > state.tokens else y


DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}
