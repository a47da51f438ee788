"""Pipeline parallel: which layers a stage holds, and the 1F1B schedule.

Layers are cut into ``pp`` stages (``vpp`` chunks each for the interleaved schedule) either evenly
or from explicit counts, as ``pipeline_num_layers`` in the reference suite: a list of pp counts,
or for vpp > 1 a list of vpp lists of pp counts (chunk c of stage s is virtual stage c * pp + s,
Megatron's interleaving).

1F1B (PipeDream-flush, Megatron's schedule without interleaving) on stage s of p with m
micro-batches: min(p - s - 1, m) warm-up forwards, then one forward and one backward in turn,
then the remaining backwards. Activations cross stages by point-to-point transfers
(mm_parallel.comm), combined into one two-way exchange where Megatron uses
send_forward_recv_backward / send_backward_recv_forward, so blocking transfers cannot deadlock.
Every transfer is preceded by its shape, so micro-batches may differ in sequence length.

Backward by recomputation: in PyNative, MindSpore's vjp runs the forward again when the backward
is asked for, so a stage keeps only each micro-batch's input; its forward runs once without tape
(to send the output on) and again inside the backward, with the received output gradient as the
cotangent. Compute per micro-batch on a stage: 2 forwards + 1 backward, about 4/3 of a plain
step (the last stage runs forward and backward at once: no extra forward). Models under full
recompute pay that forward already.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor

from mm_parallel import comm
from mm_parallel.topology import Topology, get_topology

_MAX_DIMS = 8


def stage_layer_ranges(num_layers: int, pp: int, vpp: int = 1, pipeline_num_layers=None) -> List[List[range]]:
    """ranges[chunk][stage]: the layer indices virtual stage chunk * pp + stage holds."""
    if pp < 1 or vpp < 1:
        raise ValueError(f"pp and vpp must be >= 1, got pp={pp}, vpp={vpp}")
    stages = pp * vpp
    if pipeline_num_layers is None:
        if num_layers % stages:
            raise ValueError(f"{num_layers} layers cannot be cut evenly into pp*vpp = {stages} stages; "
                             "pass pipeline_num_layers with a count per stage")
        counts = [[num_layers // stages] * pp for _ in range(vpp)]
    else:
        nested = isinstance(pipeline_num_layers[0], (list, tuple))
        counts = [list(c) for c in pipeline_num_layers] if nested else [list(pipeline_num_layers)]
        if len(counts) != vpp or any(len(c) != pp for c in counts):
            expected = f"a list of {pp} counts" if vpp == 1 else f"{vpp} lists of {pp} counts"
            raise ValueError(f"pipeline_num_layers must be {expected} (pp={pp}, vpp={vpp}), got {pipeline_num_layers}")
        if any(n < 1 for c in counts for n in c):
            raise ValueError(f"every pipeline stage needs at least one layer, got {pipeline_num_layers}")
        if sum(map(sum, counts)) != num_layers:
            raise ValueError(f"pipeline_num_layers {pipeline_num_layers} sums to {sum(map(sum, counts))}, "
                             f"the model has {num_layers} layers")
    ranges, start = [], 0
    for chunk in counts:
        row = []
        for n in chunk:
            row.append(range(start, start + n))
            start += n
        ranges.append(row)
    return ranges


class _Link:
    """Point-to-point transfers of one stage with its neighbours, each preceded by the shape."""

    def __init__(self, topology: Topology):
        pp = topology.pp
        self.first, self.last = pp.rank == 0, pp.rank == pp.size - 1
        self.prev = None if self.first else pp.ranks[pp.rank - 1]
        self.next = None if self.last else pp.ranks[pp.rank + 1]

    @staticmethod
    def _meta(x) -> Tensor:
        shape = list(x.shape) if x is not None else []
        return Tensor(np.array([len(shape)] + shape + [0] * (_MAX_DIMS - len(shape)), np.int64))

    @staticmethod
    def _shape(meta) -> Tuple[int, ...]:
        values = meta.asnumpy()
        return tuple(int(v) for v in values[1:1 + values[0]])

    def send(self, x, peer):
        comm.send(self._meta(x), peer)
        comm.send(x, peer)

    def recv(self, peer):
        shape = self._shape(comm.recv((_MAX_DIMS + 1,), ms.int64, peer))
        return comm.recv(shape, ms.float32, peer)

    def swap(self, x, peer):
        shape = self._shape(comm.exchange(self._meta(x), peer))
        return comm.exchange(x, peer, shape)

    def recv_forward(self):
        return None if self.first else self.recv(self.prev)

    def send_forward(self, y):
        if not self.last:
            self.send(y, self.next)

    def recv_backward(self):
        return None if self.last else self.recv(self.next)

    def send_backward(self, dx):
        if not self.first:
            self.send(dx, self.prev)

    def send_forward_recv_backward(self, y):
        return None if self.last else self.swap(y, self.next)

    def send_backward_recv_forward(self, dx):
        return None if self.first else self.swap(dx, self.prev)


def train_step_1f1b(stage: Callable, params: Sequence, micro_batches: Sequence[Tuple], loss_fn: Callable,
                    topology: Optional[Topology] = None):
    """One training step of ``stage`` (this rank's layers: input -> output) over micro-batches.

    micro_batches[i] = (input, target): the first stage feeds ``input`` to its layers, the last
    computes ``loss_fn(output, target)``; other stages ignore both (every rank may pass the same
    list). The step's loss is the mean over micro-batches. Returns (losses, grads): the
    per-micro-batch losses on the last stage (empty elsewhere) and the gradients of ``params``
    (this stage's trainable parameters) of the mean loss.
    """
    topo = get_topology(topology)
    link = _Link(topo)
    p, s, m = topo.pp.size, topo.pp.rank, len(micro_batches)
    if m < 1:
        raise ValueError("train_step_1f1b needs at least one micro-batch")
    params = list(params)
    grads = [ms.ops.zeros_like(q) for q in params]
    losses: List[float] = []
    inputs: List = []

    def forward(i, x):
        x = micro_batches[i][0] if link.first else x
        inputs.append(x)
        return None if link.last else stage(x)  # the last stage runs its forward inside backward

    def backward(i, dy):
        """Gradients of micro-batch i (loss / m): params accumulated, input gradient returned."""
        x = inputs.pop(0)
        position = None if link.first else 0  # the first stage's input needs no gradient
        if link.last:
            loss, out = ms.value_and_grad(lambda t: loss_fn(stage(t), micro_batches[i][1]) / m, position, params)(x)
            losses.append(float(loss.asnumpy()) * m)
        else:
            out = ms.grad(lambda t: (stage(t) * dy).sum(), position, params)(x)
        dx, new = (None, out) if position is None else out
        for k, g in enumerate(new):
            grads[k] = grads[k] + g
        return dx

    warmup = min(p - s - 1, m)
    remaining = m - warmup
    for i in range(warmup):
        link.send_forward(forward(i, link.recv_forward()))
    x = link.recv_forward() if remaining else None
    for i in range(remaining):
        y = forward(warmup + i, x)
        dx = backward(i, None if link.last else link.send_forward_recv_backward(y))
        if i == remaining - 1:
            link.send_backward(dx)
        else:
            x = link.send_backward_recv_forward(dx)
    for i in range(remaining, m):
        link.send_backward(backward(i, link.recv_backward()))
    return losses, grads
