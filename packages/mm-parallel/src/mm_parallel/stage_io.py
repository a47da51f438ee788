"""What crosses a pipeline-stage boundary: a tensor, or a dict of named tensors of any dtype and shape.

A stage passes what the next one needs — hidden states, text / timestep embeddings, masks, ids,
rotary tables — without packing them into one float tensor. A transfer is

    header   a fixed-size int64 tensor (HEADER_BYTES of JSON): [name, dtype, shape] of every
             tensor, and whether the value was a bare tensor (not a dict)
    data     one flat tensor per dtype present, the tensors of that dtype concatenated in name order

so a dict of float32 tensors costs the two transfers a single tensor always cost (shapes may
change between micro-batches: the header carries them). Backward, the gradients of the floating
tensors travel back the same way, under the same names; integer and boolean tensors get none.
Both sides of a two-way swap exchange headers first, then one buffer per dtype either side
has (a one-element placeholder where a side has none), so blocking transfers cannot deadlock.

Reading a header is a device-to-host read on the receiver. A `TransferPlan` (one per training
run, shared by both sides' schedules) makes the headers a warm-up cost: a transfer named by a key
— which boundary, which direction, the shapes of its micro-batch — sends its header the first
time the key is seen and never again; both sides keep the header under the key, so the receiver
knows what comes without asking. The contract: what a stage sends is a function of its micro-
batch's shapes (true of every mm model: sequence lengths, patch counts and frame counts are all
shapes of the batch). The sender checks each planned transfer against its kept header (shapes
are host metadata: no read) and raises if a stage broke the contract, naming the tensor.
"""

from __future__ import annotations

import json
from typing import Dict, List, Optional, Sequence, Tuple, Union

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from mm_parallel import comm
from mm_parallel.ops.device import zeros

HEADER_BYTES = 4096
DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16, "float64": ms.float64,
          "int64": ms.int64, "int32": ms.int32, "int16": ms.int16, "int8": ms.int8, "uint8": ms.uint8,
          "bool": ms.bool_}
FLOATING = ("float32", "float16", "bfloat16", "float64")
_NAMES = {dtype: name for name, dtype in DTYPES.items()}

StageValue = Union[Tensor, Dict[str, Tensor]]


def _entries(value: StageValue) -> Tuple[bool, Dict[str, Tensor]]:
    """(bare, tensors by name): a bare tensor travels as the single entry "" of a dict."""
    if isinstance(value, dict):
        for name, tensor in value.items():
            if not isinstance(tensor, Tensor):
                raise TypeError(f"a pipeline stage passes tensors only; {name!r} is {type(tensor).__name__}")
        return False, dict(sorted(value.items()))
    if not isinstance(value, Tensor):
        raise TypeError(f"a pipeline stage passes a Tensor or a dict of Tensors, got {type(value).__name__}")
    return True, {"": value}


def dtype_name(tensor: Tensor) -> str:
    if tensor.dtype not in _NAMES:
        raise TypeError(f"dtype {tensor.dtype} cannot cross a pipeline stage; use one of {sorted(DTYPES)}")
    return _NAMES[tensor.dtype]


def describe(value: StageValue) -> dict:
    """What a header says of ``value``: {"bare", "tensors": [[name, dtype, shape], ...]}."""
    bare, tensors = _entries(value)
    return {"bare": bare, "tensors": [[n, dtype_name(t), list(t.shape)] for n, t in tensors.items()]}


def header(value: StageValue) -> Tensor:
    """The fixed-size header describing ``value``."""
    raw = json.dumps(describe(value)).encode()
    if len(raw) > HEADER_BYTES - 8:
        raise ValueError(f"a pipeline stage's header needs {len(raw)} bytes, more than {HEADER_BYTES - 8}: pass "
                         "fewer tensors between stages")
    buffer = len(raw).to_bytes(8, "little") + raw.ljust(HEADER_BYTES - 8, b"\0")
    return Tensor(np.frombuffer(buffer, "<i8").copy())


def read_header(tensor: Tensor) -> dict:
    raw = tensor.asnumpy().astype("<i8").tobytes()
    length = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + length].decode())


def _groups(spec: dict) -> Dict[str, List[Tuple[str, Tuple[int, ...]]]]:
    """dtype -> [(name, shape), ...] in the header's order."""
    groups: Dict[str, List] = {}
    for name, dtype, shape in spec["tensors"]:
        groups.setdefault(dtype, []).append((name, tuple(shape)))
    return groups


def _numel(shapes) -> int:
    return sum(int(np.prod(shape, dtype=np.int64)) for _, shape in shapes)


def _flat(tensors: Dict[str, Tensor], names: Sequence[str]) -> Tensor:
    parts = [tensors[n].reshape(-1) for n in names]
    return parts[0] if len(parts) == 1 else ops.concat(parts)


def _rebuild(spec: dict, flats: Dict[str, Tensor]) -> StageValue:
    out = {}
    for dtype, members in _groups(spec).items():
        sizes = [int(np.prod(shape, dtype=np.int64)) for _, shape in members]
        pieces = [flats[dtype]] if len(sizes) == 1 else ops.split(flats[dtype], sizes)
        for (name, shape), piece in zip(members, pieces):
            out[name] = piece.reshape(shape)
    return out[""] if spec["bare"] else {name: out[name] for name, _, _ in spec["tensors"]}


class TransferPlan:
    """The headers of a run's transfers by key (module docstring); both sides of a boundary
    hold one and pass the same keys in the same order."""

    def __init__(self):
        self.specs: Dict[object, dict] = {}
        self.handshakes = 0  # headers sent or received: the first transfer of each key

    def outgoing(self, key, value: StageValue) -> Optional[dict]:
        """The kept header of a planned send (checked against ``value``), or None to send one."""
        spec, kept = describe(value), self.specs.get(key)
        if kept is None:
            self.specs[key] = spec
            self.handshakes += 1
            return None
        if spec != kept:
            changed = [f"{n or 'the tensor'} {d} {tuple(sh)}" for n, d, sh in spec["tensors"]
                       if [n, d, sh] not in kept["tensors"]]
            raise RuntimeError(f"pipeline transfer {key}: a stage sent {', '.join(changed) or 'other tensors'} where "
                               f"a micro-batch of the same shapes sent {kept['tensors']}; what a stage passes on must "
                               "follow from its micro-batch's shapes (mm_parallel.stage_io.TransferPlan)")
        return spec


def batch_shapes(batch) -> tuple:
    """A hashable key of a micro-batch's shapes and dtypes (nested dicts, lists, tensors, numpy
    arrays; other values by themselves): what a `TransferPlan` key names a micro-batch by."""
    if isinstance(batch, (Tensor, np.ndarray)):
        return ("array", tuple(batch.shape), str(batch.dtype))
    if isinstance(batch, dict):
        return ("dict",) + tuple((k, batch_shapes(v)) for k, v in sorted(batch.items()))
    if isinstance(batch, (list, tuple)):
        return ("seq",) + tuple(batch_shapes(v) for v in batch)
    return ("value", batch if isinstance(batch, (int, float, str, bool, type(None))) else type(batch).__name__)


def _send_header(value: StageValue, peer: int, plan: Optional[TransferPlan], key) -> dict:
    spec = plan.outgoing(key, value) if plan is not None else None
    if spec is None:
        spec = describe(value)
        comm.send(header(value), peer)
    return spec


def _recv_header(peer: int, plan: Optional[TransferPlan], key) -> dict:
    if plan is not None and key in plan.specs:
        return plan.specs[key]
    spec = read_header(comm.recv((HEADER_BYTES // 8,), ms.int64, peer))
    if plan is not None:
        plan.specs[key] = spec
        plan.handshakes += 1
    return spec


def send(value: StageValue, peer: int, plan: Optional[TransferPlan] = None, key=None) -> None:
    """Send ``value`` to global rank ``peer`` (which calls `recv`); with a ``plan``, the header
    only the first time ``key`` is seen."""
    _, tensors = _entries(value)
    for members in _groups(_send_header(value, peer, plan, key)).values():
        comm.send(_flat(tensors, [n for n, _ in members]), peer)


def recv(peer: int, plan: Optional[TransferPlan] = None, key=None) -> StageValue:
    """Receive what global rank ``peer`` passes to `send` (the same ``plan`` and ``key``)."""
    spec = _recv_header(peer, plan, key)
    flats = {dtype: comm.recv((_numel(members),), DTYPES[dtype], peer) for dtype, members in _groups(spec).items()}
    return _rebuild(spec, flats)


def swap(value: StageValue, peer: int, plan: Optional[TransferPlan] = None, keys=(None, None)) -> StageValue:
    """Send ``value`` to ``peer`` and receive what ``peer`` sends at the same time; ``keys``:
    (this side's send, its receive) under a ``plan``, the peer's the same two swapped. Both sides
    know both keys or neither (each key is learned by both ends of its transfer), so they agree
    on whether headers cross."""
    _, tensors = _entries(value)
    out_key, in_key = keys
    if plan is not None and out_key in plan.specs and in_key in plan.specs:
        ours, theirs = plan.outgoing(out_key, value), plan.specs[in_key]
    else:
        ours = describe(value)
        theirs = read_header(comm.exchange(header(value), peer))
        if plan is not None:
            plan.specs[out_key], plan.specs[in_key] = ours, theirs
            plan.handshakes += 2
    ours, incoming = _groups(ours), _groups(theirs)
    flats = {}
    for dtype in sorted(set(ours) | set(incoming)):  # the same order on both sides
        outgoing = _flat(tensors, [n for n, _ in ours[dtype]]) if dtype in ours else zeros((1,), DTYPES[dtype])
        got = comm.exchange(outgoing, peer, (max(_numel(incoming.get(dtype, [])), 1),))
        if dtype in incoming:
            flats[dtype] = got
    return _rebuild(theirs, flats)


# -- autodiff across the boundary -------------------------------------------------------------------

def differentiable(value: StageValue) -> List[str]:
    """The names of the floating tensors of a stage input (the ones that get gradients)."""
    _, tensors = _entries(value)
    return [name for name, t in tensors.items() if dtype_name(t) in FLOATING]


def with_tensors(value: StageValue, names: Sequence[str], tensors: Sequence[Tensor]) -> StageValue:
    """``value`` with the tensors ``names`` replaced (a bare tensor: the one given)."""
    if not isinstance(value, dict):
        return tensors[0]
    return {**value, **dict(zip(names, tensors))}


def gradients(value: StageValue, names: Sequence[str], grads: Sequence[Tensor]) -> StageValue:
    """The gradient to send back for a stage input: a tensor for a bare one, else a dict of the
    floating tensors' gradients."""
    if not isinstance(value, dict):
        return grads[0]
    return dict(zip(names, grads))


def dot(output: StageValue, cotangent: Optional[StageValue]):
    """sum over entries of sum(y * dy): the scalar whose gradient is the vector-Jacobian product."""
    if not isinstance(output, dict):
        return _dot(output, cotangent)
    total = None
    for name, dy in (cotangent or {}).items():
        term = _dot(output[name], dy)
        total = term if total is None else total + term
    if total is None:
        raise ValueError("the next stage sent no gradient: nothing the stage outputs is differentiable")
    return total


def _dot(y, dy):
    if y.dtype != ms.float32:  # half-precision products summed in float32
        y, dy = y.astype(ms.float32), dy.astype(ms.float32)
    return (y * dy).sum()
