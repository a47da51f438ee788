"""Pipeline parallel: which layers a stage holds, and the 1F1B and interleaved (VPP) schedules.

Layers are cut into ``pp`` stages (``vpp`` chunks each for the interleaved schedule) either evenly
or from explicit counts, as ``pipeline_num_layers`` in the reference suite: a list of pp counts,
or for vpp > 1 a list of vpp lists of pp counts (chunk c of stage s is virtual stage c * pp + s,
Megatron's interleaving).

1F1B (PipeDream-flush, Megatron's schedule without interleaving) on stage s of p with m
micro-batches: min(p - s - 1, m) warm-up forwards, then one forward and one backward in turn,
then the remaining backwards. Activations cross stages by point-to-point transfers
(mm_parallel.comm), combined into one two-way exchange where Megatron uses
send_forward_recv_backward / send_backward_recv_forward, so blocking transfers cannot deadlock.
A stage passes a tensor or a dict of named tensors of any dtype (mm_parallel.stage_io); every
transfer carries its names, dtypes and shapes, so micro-batches may differ in sequence length.

The interleaved schedule (VPP) keeps Megatron's per-stage order but runs in ticks: a static
schedule every rank derives alike (`interleaved_ticks`) says which op each stage runs at each
tick, and the tick's transfers follow one global order, so blocking transfers cannot deadlock.
Measured on CPU (benchmarks/pipeline_bubble.py) this lockstep costs more than the bubble it
saves: every tick waits for its slowest stage and transfers (two collectives each) queue behind
each other; on Ascend with HCCL point-to-point the transfers are far cheaper, but the lockstep
remains a limit of this implementation.

Backward by recomputation: in PyNative, MindSpore's vjp runs the forward again when the backward
is asked for, so a stage keeps only each micro-batch's input; its forward runs once without tape
(to send the output on) and again inside the backward, with the received output gradient as the
cotangent. Compute per micro-batch on a stage: 2 forwards + 1 backward, about 4/3 of a plain
step; measured on CPU (4 transformer blocks, hidden 256, seq 512, median of 5): 1.41x a plain
forward + backward. The last stage runs forward and backward at once (no extra forward), and
models under full recompute pay that forward already.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import ops

from mm_parallel import stage_io
from mm_parallel.ops.device import as_type, use_fused
from mm_parallel.topology import Topology, get_topology


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
    """Point-to-point transfers of one stage with its neighbours (mm_parallel.stage_io: a tensor
    or a dict of named tensors). With a `stage_io.TransferPlan` each transfer is keyed by
    (direction, the sending virtual stage, micro-batch i's shapes): its header crosses once."""

    def __init__(self, topology: Topology, plan: Optional[stage_io.TransferPlan] = None,
                 micro_batches: Sequence[Tuple] = ()):
        pp = topology.pp
        self.p, self.s = pp.size, pp.rank
        self.first, self.last = pp.rank == 0, pp.rank == pp.size - 1
        self.prev = None if self.first else pp.ranks[pp.rank - 1]
        self.next = None if self.last else pp.ranks[pp.rank + 1]
        self.plan = plan
        self.shapes = [stage_io.batch_shapes(batch[0]) for batch in micro_batches] if plan is not None else []

    def key(self, kind: str, sender: int, i: int):
        """The plan's key of micro-batch i's ``kind`` ("F" / "B") transfer from virtual stage ``sender``."""
        return (kind, sender, self.shapes[i]) if self.plan is not None else None

    def send(self, value, peer: int, key=None):
        stage_io.send(value, peer, self.plan, key)

    def recv(self, peer: int, key=None):
        return stage_io.recv(peer, self.plan, key)

    def recv_forward(self, i: int):
        return None if self.first else self.recv(self.prev, self.key("F", self.s - 1, i))

    def send_forward(self, y, i: int):
        if not self.last:
            self.send(y, self.next, self.key("F", self.s, i))

    def recv_backward(self, i: int):
        return None if self.last else self.recv(self.next, self.key("B", self.s + 1, i))

    def send_backward(self, dx, i: int):
        if not self.first:
            self.send(dx, self.prev, self.key("B", self.s, i))

    def send_forward_recv_backward(self, y, i_forward: int, i_backward: int):
        if self.last:
            return None
        keys = (self.key("F", self.s, i_forward), self.key("B", self.s + 1, i_backward))
        return stage_io.swap(y, self.next, self.plan, keys)

    def send_backward_recv_forward(self, dx, i_backward: int, i_forward: int):
        if self.first:
            return None
        keys = (self.key("B", self.s, i_backward), self.key("F", self.s - 1, i_forward))
        return stage_io.swap(dx, self.prev, self.plan, keys)


def _micro_backward(fn: Callable, x, params: List, needs_dx: bool, objective: Callable):
    """Backward of one micro-batch on a stage by recomputing its forward: the value of
    ``objective(fn(x))`` (the loss / m on the last stage, sum(fn(x) * dy) elsewhere), the gradient
    of ``x`` (a tensor, or a dict over its floating tensors; None unless ``needs_dx``) and the
    gradients of ``params``."""
    # x of the first stage (anything, e.g. a dict of host data) stays out of autodiff; a dict of
    # only ids / masks has nothing to differentiate (an empty dict goes back)
    names = stage_io.differentiable(x) if needs_dx else []
    inputs = [x] if needs_dx and not isinstance(x, dict) else [x[n] for n in names]
    if not inputs:
        value, grads = ms.value_and_grad(lambda: objective(fn(x)), None, params)()
        return value, ({} if needs_dx else None), grads
    run = lambda *tensors: objective(fn(stage_io.with_tensors(x, names, tensors)))  # noqa: E731
    value, (dxs, grads) = ms.value_and_grad(run, tuple(range(len(inputs))), params)(*inputs)
    dxs = list(dxs) if isinstance(dxs, (tuple, list)) else [dxs]
    return value, stage_io.gradients(x, names, dxs), grads


def _caller(stage: Callable, micro_batches: Sequence[Tuple], with_batch: bool) -> Callable:
    """call(i, x): the stage on activation x of micro-batch i; with ``with_batch`` the stage also
    gets the micro-batch's input (host-side data every stage may need: positions, masks)."""
    if with_batch:
        return lambda i, x: stage(x, micro_batches[i][0])
    return lambda i, x: stage(x)


def _accumulate(sums: List, new: Sequence, grad_dtype) -> List:
    """Gradient sums with one micro-batch's gradients added, in ``grad_dtype`` (None: each
    parameter's dtype; fp32 for bf16 parameters is Megatron's main_grad). The first micro-batch's
    gradients start the sums (``sums`` all None): no zeros made per step."""
    return [as_type(b, grad_dtype or b.dtype) if a is None else a + as_type(b, a.dtype) for a, b in zip(sums, new)]


def _micro_loss(value, m: int):
    """A micro-batch's loss (``value`` is loss / m): a float on the CPU path, an unread device
    tensor on the device path (read with the step's other figures, when a row is written)."""
    return value * m if use_fused() else float(value.asnumpy()) * m


def mean_loss(losses: Sequence):
    """The step's loss, a float32 scalar tensor: the mean of the micro-batch losses a train step
    returned (floats, or device tensors left unread on the device path)."""
    if all(isinstance(loss, float) for loss in losses):
        return ms.Tensor(np.float32(np.mean(losses)))
    return ops.stack([loss.reshape(()).astype(ms.float32) for loss in losses]).mean()


def train_step_1f1b(stage: Callable, params: Sequence, micro_batches: Sequence[Tuple], loss_fn: Callable,
                    topology: Optional[Topology] = None, with_batch: bool = False, grad_dtype=None,
                    plan: Optional[stage_io.TransferPlan] = None):
    """One training step of ``stage`` (this rank's layers: input -> output) over micro-batches.

    micro_batches[i] = (input, target): the first stage feeds ``input`` to its layers, the last
    computes ``loss_fn(output, target)``; other stages ignore both (every rank may pass the same
    list) unless ``with_batch``, which calls every stage as ``stage(x, input)``. Activations between
    stages are tensors or dicts of named tensors of any dtype (mm_parallel.stage_io). The step's loss is the mean over
    micro-batches. Returns (losses,
    grads): the per-micro-batch losses on the last stage (empty elsewhere; device tensors on the
    device path, see `_micro_loss`) and the gradients of
    ``params`` (this stage's trainable parameters) of the mean loss, summed over micro-batches in
    ``grad_dtype`` (default: each parameter's dtype). ``plan``: the run's `stage_io.TransferPlan`
    (headers cross once per key instead of with every transfer).
    """
    topo = get_topology(topology)
    link = _Link(topo, plan, micro_batches)
    p, s, m = topo.pp.size, topo.pp.rank, len(micro_batches)
    if m < 1:
        raise ValueError("train_step_1f1b needs at least one micro-batch")
    params = list(params)
    grads: List = [None] * len(params)
    losses: List[float] = []
    inputs: List = []
    call = _caller(stage, micro_batches, with_batch)

    def forward(i, x):
        x = micro_batches[i][0] if link.first else x
        inputs.append(x)
        return None if link.last else call(i, x)  # the last stage runs its forward inside backward

    def backward(i, dy):
        """Gradients of micro-batch i (loss / m): params accumulated, input gradient returned."""
        objective = (lambda y: loss_fn(y, micro_batches[i][1]) / m) if link.last else (lambda y: stage_io.dot(y, dy))
        # the first stage's input needs no gradient
        value, dx, new = _micro_backward(lambda t: call(i, t), inputs.pop(0), params, not link.first, objective)
        if link.last:
            losses.append(_micro_loss(value, m))
        grads[:] = _accumulate(grads, new, grad_dtype)
        return dx

    warmup = min(p - s - 1, m)
    remaining = m - warmup
    for i in range(warmup):
        link.send_forward(forward(i, link.recv_forward(i)), i)
    x = link.recv_forward(warmup) if remaining else None
    for i in range(remaining):
        y = forward(warmup + i, x)
        dx = backward(i, None if link.last else link.send_forward_recv_backward(y, warmup + i, i))
        if i == remaining - 1:
            link.send_backward(dx, i)
        else:
            x = link.send_backward_recv_forward(dx, i, warmup + i + 1)
    for i in range(remaining, m):
        link.send_backward(backward(i, link.recv_backward(i)), i)
    return losses, grads


def interleaved_order(p: int, v: int, m: int, stage: int) -> List[Tuple[str, int, int]]:
    """Megatron's interleaved 1F1B order on ``stage``: [("F" | "B", chunk, micro-batch), ...].

    Virtual step k covers micro-batches in groups of p: chunk (k // p) % v (backward: counted from
    the last chunk), micro-batch (k // (p v)) p + k % p. Warm-up: 2 (p - stage - 1) + (v - 1) p
    forwards (all of them when that reaches m v)."""
    total = m * v

    def unit(k, backward):
        chunk = (k // p) % v
        return (v - 1 - chunk if backward else chunk), (k // (p * v)) * p + k % p

    warmup = min(2 * (p - stage - 1) + (v - 1) * p, total)
    order = [("F",) + unit(k, False) for k in range(warmup)]
    for k in range(total - warmup):
        order += [("F",) + unit(warmup + k, False), ("B",) + unit(k, True)]
    return order + [("B",) + unit(k, True) for k in range(total - warmup, total)]


def interleaved_ticks(p: int, v: int, m: int) -> List[List[Optional[Tuple[str, int, int]]]]:
    """ticks[t][stage]: the op each stage runs at tick t (None: idle), each stage keeping its
    interleaved order and starting an op once its inputs arrived (a tick after they were made)."""
    orders = [interleaved_order(p, v, m, s) for s in range(p)]
    done = {}  # (kind, virtual stage, micro-batch) -> tick it ran
    cursor, ticks, last = [0] * p, [], p * v - 1
    while any(cursor[s] < len(orders[s]) for s in range(p)):
        t, row = len(ticks), []
        for s in range(p):
            op = orders[s][cursor[s]] if cursor[s] < len(orders[s]) else None
            if op is not None:
                kind, chunk, i = op
                vs = chunk * p + s
                need = [("F", vs - 1, i)] if kind == "F" and vs > 0 else []
                need += [("B", vs + 1, i)] if kind == "B" and vs < last else []
                need += [("F", vs, i)] if kind == "B" else []
                if all(n in done and done[n] < t for n in need):
                    cursor[s] += 1
                else:
                    op = None
            row.append(op)
        for s, op in enumerate(row):
            if op is not None:
                done[(op[0], op[1] * p + s, op[2])] = t
        if all(op is None for op in row):
            raise RuntimeError(f"interleaved schedule stalled at tick {t} (pp={p}, vpp={v}, m={m})")
        ticks.append(row)
    return ticks


def train_step_interleaved(chunks: Sequence[Callable], chunk_params: Sequence[Sequence], micro_batches: Sequence[Tuple],
                           loss_fn: Callable, topology: Optional[Topology] = None, with_batch: bool = False,
                           grad_dtype=None, plan: Optional[stage_io.TransferPlan] = None):
    """Interleaved 1F1B (VPP): this stage holds ``vpp`` chunks (chunks[c] is virtual stage c * pp +
    stage). Same contract as `train_step_1f1b`; returns (losses, grads[chunk][param]).

    The order is Megatron's; the transfers of each tick follow one global order every rank
    derives from the same static schedule (`interleaved_ticks`), so blocking transfers cannot
    deadlock. Needs micro-batches in multiples of pp (Megatron's rule)."""
    topo = get_topology(topology)
    p, s, v, m = topo.pp.size, topo.pp.rank, len(chunks), len(micro_batches)
    if p < 2 or v < 2:
        raise ValueError(f"the interleaved schedule needs pp >= 2 and vpp >= 2 chunks, got pp={p}, vpp={v}")
    if m % p:
        raise ValueError(f"the interleaved schedule needs a number of micro-batches divisible by pp={p}, got {m}")
    link, last = _Link(topo, plan, micro_batches), p * v - 1
    params = [list(c) for c in chunk_params]
    grads: List = [[None] * len(c) for c in params]
    inputs, douts, outgoing, losses = {}, {}, {}, {}
    calls = [_caller(c, micro_batches, with_batch) for c in chunks]

    def run(kind, chunk, i):
        vs = chunk * p + s
        x = micro_batches[i][0] if vs == 0 else inputs[chunk, i]
        if kind == "F":
            inputs[chunk, i] = x
            if vs < last:
                outgoing["F", chunk, i] = calls[chunk](i, x)
            return
        if vs == last:
            objective = lambda y: loss_fn(y, micro_batches[i][1]) / m
        else:
            dy = douts.pop((chunk, i))
            objective = lambda y: stage_io.dot(y, dy)
        value, dx, new = _micro_backward(lambda t: calls[chunk](i, t), x, params[chunk], vs > 0, objective)
        if vs == last:
            losses[i] = _micro_loss(value, m)
        grads[chunk] = _accumulate(grads[chunk], new, grad_dtype)
        del inputs[chunk, i]
        if vs > 0:
            outgoing["B", chunk, i] = dx

    for row in interleaved_ticks(p, v, m):
        if row[s] is not None:
            run(*row[s])
        # this tick's transfers, in the same global order on every rank
        for sender, op in enumerate(row):
            if op is None:
                continue
            kind, chunk, i = op
            vs = chunk * p + sender
            if (kind == "F" and vs == last) or (kind == "B" and vs == 0):
                continue
            receiver = (sender + 1) % p if kind == "F" else (sender - 1) % p
            if sender == s:
                link.send(outgoing.pop((kind, chunk, i)), topo.pp.ranks[receiver], link.key(kind, vs, i))
            elif receiver == s:
                got = link.recv(topo.pp.ranks[sender], link.key(kind, vs, i))
                if kind == "F":  # the next virtual stage's input
                    inputs[chunk + (sender == p - 1), i] = got
                else:  # the gradient of the previous virtual stage's output
                    douts[chunk - (sender == 0), i] = got
    return [losses[i] for i in sorted(losses)], grads


def forward_only(chunks: Sequence[Callable], micro_batches: Sequence[Tuple], output_fn: Callable,
                 topology: Optional[Topology] = None, with_batch: bool = False,
                 plan: Optional[stage_io.TransferPlan] = None, keys: Optional[Sequence] = None) -> List:
    """Forward passes without backward (validation, sampling): micro-batch by micro-batch through
    the p * v virtual stages (chunks[c] of this stage is virtual stage c * p + stage, as in
    `train_step_interleaved`; one chunk for plain pp). Returns ``[output_fn(y, target)]`` per
    micro-batch on the rank of the last virtual stage, an empty list elsewhere.

    Each micro-batch crosses the virtual stages in their order, one transfer at a time, so blocking
    transfers cannot deadlock; nothing overlaps (no bubble is hidden), which an evaluation every
    so many steps can afford. With a ``plan`` (stage_io.TransferPlan) micro-batch i's transfers
    are keyed by ``keys[i]`` (what the stages pass follows from it; default its shapes): a
    decoder's one-token steps send their headers once."""
    topo = get_topology(topology)
    p, s, v = topo.pp.size, topo.pp.rank, len(chunks)
    calls = [_caller(c, micro_batches, with_batch) for c in chunks]
    last, outputs = p * v - 1, []
    for i, (first_input, target) in enumerate(micro_batches):
        x, key = first_input, None
        if plan is not None:
            key = keys[i] if keys is not None else stage_io.batch_shapes(first_input)
        for vs in range(p * v):
            owner, receiver = vs % p, (vs + 1) % p
            planned = None if key is None else ("F", vs, key)
            if owner == s:
                y = calls[vs // p](i, x if vs else first_input)
                if vs == last:
                    outputs.append(output_fn(y, target))
                elif receiver == s:  # one stage holds both (p == 1): no transfer
                    x = y
                else:
                    stage_io.send(y, topo.pp.ranks[receiver], plan, planned)
            elif receiver == s and vs < last:
                x = stage_io.recv(topo.pp.ranks[owner], plan, planned)
    return outputs
