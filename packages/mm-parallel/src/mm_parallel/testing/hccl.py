"""Stand-ins for the HCCL calls of ``mindspore.mint.distributed`` that the native backend makes.

Each function has the signature of the MindSpore 2.7 call it replaces and its documented
semantics (the "mindspore.mint.distributed" section of the r2.7.2 API pages; the installed
mindspore 2.7.2's docstrings are the same text): results written in place into the output tensor
(and the receive tensors of batched p2p), ``peer`` / ``src`` / ``dst`` global ranks, group names
as ``new_group`` returns them. The data moves by files (`mm_parallel.testing.hccl_mailbox`) and
every result is computed here with numpy from the members' inputs: nothing of mm's CPU backend,
which the native backend's results are compared with, runs underneath.

Refused, each with the line it enforces (`LINES`): what the pages' Raises sections name (types,
ops, split sizes), and what HCCL itself, which the calls reach on Ascend, documents for Atlas A2
training products (CANN 8.x HCCL API reference): the dtypes of each collective, "prod" with
int16 / bfp16, members that disagree on count, dtype, op or root, and send / receive counts of
an all-to-all that do not match between ranks. An output that is its own input is refused too:
HCCL reads sendBuf while it writes recvBuf.

What the pages leave to the device (HCCL's own ordering of p2p operations) is the order of the
list: each isend is delivered when the batch runs, each irecv waits for its message. An
asynchronous gather (async_op=True) delivers its output at the handle's wait, NaN before it.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor

from mm_parallel.testing.hccl_mailbox import Mailbox, Message
from mm_parallel.topology import Group

LINES = {
    "reduce_dtypes": "HcclAllReduce / HcclReduceScatter, Atlas A2: the supported data types are int8, int16, "
                     "int32, int64, float16, float32, bfp16",
    "prod": "HcclAllReduce / HcclReduceScatter, Atlas A2: the \"prod\" operation does not support int16, bfp16",
    "move_dtypes": "HcclAllGather / HcclAlltoAllV / HcclBroadcast / HcclSend, Atlas A2: the supported data types "
                   "are int8, uint8, int16, uint16, int32, uint32, int64, uint64, float16, float32, float64, bfp16",
    "same": "Note: The tensors must have the same shape and format in all processes of the collection "
            "(HCCL: the count, dataType and op (root) of every rank must be the same)",
    "op": "For all_reduce, the input op value must be one of sum, prod, min, max",
    "split": "ValueError: When `input_split_sizes` is empty, input dim 0 can not be divided by ``world_size``",
    "counts": "HcclAlltoAllV: sendCounts[i] is what this rank sends to rank i, recvCounts[i] what it receives "
              "from rank i",
    "output": "reduce_scatter_tensor: output(Tensor): the output tensor has the same dtype as `input_x` with a "
              "shape of (N/rank_size, *)",
    "dst": "send: ValueError: If the `dst` process rank id is same as the current process",
    "p2p": "batch_isend_irecv: The 'isend' and 'irecv' of `P2POp` in `p2p_op_list` between ranks need to match "
           "each other",
}
_REDUCE = {ms.int8, ms.int16, ms.int32, ms.int64, ms.float16, ms.float32, ms.bfloat16}
_MOVE = _REDUCE | {ms.uint8, ms.uint16, ms.uint32, ms.uint64, ms.float64}
_OPS = ("sum", "prod", "min", "max")

_STATE: Dict[str, object] = {"groups": {}, "fail_new_group": False, "mailbox": None}


def _refuse(kind: str, line: str, detail: str):
    raise kind(f"HCCL stand-in: {detail} — {LINES[line]}")


def _world() -> Tuple[int, int]:
    from mindspore.communication import get_group_size, get_rank

    return get_group_size(), get_rank()


def _mailbox() -> Mailbox:
    if _STATE["mailbox"] is None:
        _STATE["mailbox"] = Mailbox(_world()[1])
    return _STATE["mailbox"]


def _group(name: Optional[str]) -> Group:
    if name is not None and not isinstance(name, str):
        raise TypeError(f"The argument 'group' must be type of string, but got 'group' type : {type(name)}.")
    size, rank = _world()
    if name is None or name not in _STATE["groups"]:
        if name is not None and not name.endswith("world_group"):
            raise RuntimeError(f"group {name!r} was not created by new_group")
        return Group(tuple(range(size)), rank, "world")
    ranks = _STATE["groups"][name]
    if rank not in ranks:
        raise RuntimeError(f"rank {rank} is not a member of group {name!r} {list(ranks)}")
    return Group(ranks, ranks.index(rank), name)


def _check_tensors(**tensors):
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")


def _check_dtype(t, allowed, line: str, call: str):
    if t.dtype not in allowed:
        _refuse(TypeError, line, f"{call} of {t.dtype}")


def _check_distinct(output, input_, call: str):
    if output is input_:
        raise ValueError(f"HCCL stand-in: {call} was given one tensor as input and output; HCCL reads the "
                         "send buffer while it writes the receive buffer: pass a separate output")


class _Done:
    """CommHandle of a finished operation (async_op=True)."""

    def wait(self):
        return True


class _Arriving:
    """CommHandle of an asynchronous operation whose output arrives at ``wait()`` (HCCL: "the
    output is valid after the handle's wait"). Until then the output holds NaN (a floating one),
    so that a use before the wait poisons what is computed from it; handles not yet waited on
    are counted in `unwaited`."""

    def __init__(self, output, values: np.ndarray):
        self.output, self.values = output, values
        _STATE["unwaited"] = _STATE.get("unwaited", 0) + 1
        if output.dtype in (ms.float16, ms.bfloat16, ms.float32, ms.float64):
            _fill(output, np.full(output.shape, np.nan, np.float32))

    def wait(self):
        if self.values is not None:
            _fill(self.output, self.values)
            self.values = None
            _STATE["unwaited"] -= 1
        return True


def unwaited() -> int:
    """Asynchronous operations begun and not yet waited on."""
    return _STATE.get("unwaited", 0)


def _handle(async_op):
    if not isinstance(async_op, bool):
        raise TypeError(f"The argument 'async_op' must be a bool, but got {type(async_op)}.")
    return _Done() if async_op else None


def _host(t) -> np.ndarray:
    """The tensor's values in numpy (bfloat16 as float32: exact)."""
    return (t.astype(ms.float32) if t.dtype == ms.bfloat16 else t).asnumpy()


def _message(call: str, t, **arguments) -> Message:
    data = _host(t)
    return {"name": call, "dtype": str(t.dtype), "shape": list(data.shape), "storage": data.dtype.str,
            **arguments}, data


def _fill(out, values: np.ndarray) -> None:
    """Write ``values`` into ``out`` in place, rounded once to out's dtype."""
    if out.size == 0:
        return
    host = values.astype(np.float32 if out.dtype == ms.bfloat16 else ms.dtype_to_nptype(out.dtype))
    out.copy_(Tensor(host.reshape(out.shape)).astype(out.dtype))


def _gathered(call: str, group: Group, t, agree=("dtype", "shape"), **arguments) -> List[Message]:
    """Every member's message; refuses members that called something else or disagree on ``agree``."""
    messages = _mailbox().gather(group.ranks, _message(call, t, **arguments))
    mine = messages[group.rank][0]
    for rank, (header, _) in zip(group.ranks, messages):
        if header["name"] != call:
            raise RuntimeError(f"HCCL stand-in: rank {rank} called {header['name']} where this rank called {call} "
                               f"on ranks {list(group.ranks)}: members must call a group's collectives in one order")
        for key in agree:
            if header[key] != mine[key]:
                _refuse(ValueError, "same", f"{call}: rank {rank} has {key} {header[key]}, this rank {mine[key]}")
    return messages


def _reduce(arrays: List[np.ndarray], op: str) -> np.ndarray:
    stacked = np.stack(arrays)
    if np.issubdtype(stacked.dtype, np.floating):
        stacked = stacked.astype(np.float64)  # one rounding, at the end
    return {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min}[op](stacked, axis=0)


def _check_op(op, call: str, t):
    if not isinstance(op, str):
        raise TypeError(f"For {call}, the input op type must be str")
    if op not in _OPS:
        _refuse(TypeError, "op", f"{call} with op {op!r}")
    _check_dtype(t, _REDUCE, "reduce_dtypes", call)
    if op == "prod" and t.dtype in (ms.int16, ms.bfloat16):
        _refuse(TypeError, "prod", f"{call} prod of {t.dtype}")


def fail_group_creation(fail: bool) -> None:
    """Make new_group fail as MindSpore documents it: return "" (to test the callers' check)."""
    _STATE["fail_new_group"] = bool(fail)


def new_group(ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False,
              group_desc=None):
    """A group name for ``ranks`` (all ranks when None); "" when creation fails. Duplicate ranks: TypeError."""
    size, _ = _world()
    ranks = tuple(range(size)) if ranks is None else tuple(int(r) for r in ranks)
    if len(set(ranks)) != len(ranks):
        raise TypeError(f"ranks {list(ranks)} has duplicate rank ids")
    if backend not in (None, "hccl", "mccl"):
        raise ValueError(f"backend {backend!r} is not hccl or mccl")
    if _STATE["fail_new_group"] or any(not 0 <= r < size for r in ranks):
        return ""
    if ranks == tuple(range(size)):
        return "hccl_world_group"
    name = "hccl_" + "_".join(str(r) for r in ranks)
    _STATE["groups"][name] = tuple(sorted(ranks))
    return name


def all_reduce(tensor, op="sum", group=None, async_op=False):
    """tensor (in place) = op over the members' tensors, element-wise."""
    _check_tensors(tensor=tensor)
    _check_op(op, "all_reduce", tensor)
    g = _group(group)
    messages = _gathered("all_reduce", g, tensor, agree=("dtype", "shape", "op"), op=op)
    _fill(tensor, _reduce([data for _, data in messages], op))
    return _handle(async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """output (N x_1, x_2, ...) = the members' inputs (x_1, x_2, ...) stacked on dim 0."""
    _check_tensors(output_tensor=output_tensor, input_tensor=input_tensor)
    _check_dtype(input_tensor, _MOVE, "move_dtypes", "all_gather_into_tensor")
    _check_distinct(output_tensor, input_tensor, "all_gather_into_tensor")
    g = _group(group)
    want = (input_tensor.shape[0] * g.size,) + tuple(input_tensor.shape[1:])
    if tuple(output_tensor.shape) != want or output_tensor.dtype != input_tensor.dtype:
        raise ValueError(f"output_tensor must be {want} {input_tensor.dtype} for {g.size} ranks, got "
                         f"{tuple(output_tensor.shape)} {output_tensor.dtype}")
    messages = _gathered("all_gather_into_tensor", g, input_tensor)
    gathered = np.concatenate([data for _, data in messages], axis=0)
    if async_op is True:  # the data is there only after the handle's wait
        return _Arriving(output_tensor, gathered)
    _fill(output_tensor, gathered)
    return _handle(async_op)


def reduce_scatter_tensor(output, input, op="sum", group=None, async_op=False):  # noqa: A002 - documented name
    """output (N / size, ...) = this member's chunk of the reduction of the inputs (N, ...)."""
    _check_tensors(output=output, input=input)
    _check_op(op, "reduce_scatter_tensor", input)
    _check_distinct(output, input, "reduce_scatter_tensor")
    g = _group(group)
    if input.shape[0] % g.size:
        raise ValueError(f"the first dimension {input.shape[0]} cannot be divided by the rank size {g.size}")
    want = (input.shape[0] // g.size,) + tuple(input.shape[1:])
    if tuple(output.shape) != want or output.dtype != input.dtype:
        _refuse(ValueError, "output", f"output {tuple(output.shape)} {output.dtype} for input "
                f"{tuple(input.shape)} {input.dtype} on {g.size} ranks")
    messages = _gathered("reduce_scatter_tensor", g, input, agree=("dtype", "shape", "op"), op=op)
    rows = want[0]
    _fill(output, _reduce([data[g.rank * rows:(g.rank + 1) * rows] for _, data in messages], op))
    return _handle(async_op)


def _split_sizes(sizes, rows, size, what) -> List[int]:
    if sizes is None or len(sizes) == 0:
        if rows % size:
            _refuse(ValueError, "split", f"{what} dim 0 is {rows} on {size} ranks")
        return [rows // size] * size
    if not isinstance(sizes, (list, tuple)) or not all(isinstance(s, int) and s >= 0 for s in sizes):
        raise TypeError(f"{what}_split_sizes must be a list or tuple of ints >= 0, got {sizes!r}")
    if len(sizes) != size or sum(sizes) != rows:
        _refuse(ValueError, "counts", f"{what}_split_sizes {list(sizes)} must be {size} sizes adding up to {rows}")
    return list(sizes)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,  # noqa: A002
                      async_op=False):
    """Rows [sum(in[:k]), sum(in[:k+1])) of input go to member k; output stacks what member k
    sent here (output_split_sizes[k] rows) in member order."""
    _check_tensors(output=output, input=input)
    _check_dtype(input, _MOVE, "move_dtypes", "all_to_all_single")
    _check_distinct(output, input, "all_to_all_single")
    g = _group(group)
    if output.dtype != input.dtype or tuple(output.shape[1:]) != tuple(input.shape[1:]):
        raise ValueError(f"all_to_all_single: output {tuple(output.shape)} {output.dtype} and input "
                         f"{tuple(input.shape)} {input.dtype} must share the dtype and every dimension but the first")
    send = _split_sizes(input_split_sizes, input.shape[0], g.size, "input")
    recv = _split_sizes(output_split_sizes, output.shape[0], g.size, "output")
    messages = _gathered("all_to_all_single", g, input, agree=("dtype",), send=send, recv=recv)
    pieces = []
    for k, (header, data) in enumerate(messages):
        if header["send"][g.rank] != recv[k] or header["shape"][1:] != list(input.shape[1:]):
            _refuse(ValueError, "counts", f"rank {g.ranks[k]} sends {header['send'][g.rank]} rows of "
                    f"{header['shape'][1:]} here, this rank expects {recv[k]} of {list(input.shape[1:])}")
        start = sum(header["send"][: g.rank])
        pieces.append(data[start : start + recv[k]])
    _fill(output, np.concatenate(pieces, axis=0))
    return _handle(async_op)


def broadcast(tensor, src, group=None, async_op=False):
    """tensor (in place) = rank ``src``'s tensor, on every member."""
    _check_tensors(tensor=tensor)
    if not isinstance(src, int):
        raise TypeError("For broadcast, the src must be int")
    _check_dtype(tensor, _MOVE, "move_dtypes", "broadcast")
    g = _group(group)
    if src not in g.ranks:
        raise ValueError(f"broadcast: src {src} is not a member of {list(g.ranks)}")
    messages = _gathered("broadcast", g, tensor, agree=("dtype", "shape", "src"), src=src)
    _fill(tensor, messages[g.ranks.index(src)][1])
    return _handle(async_op)


def barrier(group=None, async_op=False, device_ids=None):
    _gathered("barrier", _group(group), Tensor(np.zeros(1, np.float32)))
    return _handle(async_op)


def _p2p_peer(peer, what: str) -> int:
    if not isinstance(peer, int):
        raise TypeError(f"{what} must be an int, got {type(peer).__name__}")
    size, rank = _world()
    if peer == rank:
        _refuse(ValueError, "dst", f"{what} {peer} is this rank")
    if not 0 <= peer < size:
        raise ValueError(f"{what} {peer} is not a rank of the world of {size}")
    return peer


def _deliver(tensor, dst, call: str) -> None:
    _check_dtype(tensor, _MOVE, "move_dtypes", call)
    _mailbox().send(_p2p_peer(dst, "dst"), _message(call, tensor))


def _collect(tensor, src, call: str) -> None:
    _check_dtype(tensor, _MOVE, "move_dtypes", call)
    header, data = _mailbox().receive(_p2p_peer(src, "src"))
    if header["dtype"] != str(tensor.dtype) or header["shape"] != list(tensor.shape):
        _refuse(ValueError, "p2p", f"{call} from rank {src} into {tuple(tensor.shape)} {tensor.dtype}, which "
                f"sent {tuple(header['shape'])} {header['dtype']}")
    _fill(tensor, data)


def send(tensor, dst=0, group=None, tag=0):
    _check_tensors(tensor=tensor)
    _deliver(tensor, dst, "send")


def recv(tensor, src=0, group=None, tag=0):
    _check_tensors(tensor=tensor)
    _collect(tensor, src, "recv")
    return 0


def isend(tensor, dst=0, group=None, tag=0):
    raise NotImplementedError("the stand-in runs isend inside batch_isend_irecv only")


def irecv(tensor, src=0, group=None, tag=0):
    raise NotImplementedError("the stand-in runs irecv inside batch_isend_irecv only")


class P2POp:
    """One isend / irecv of a batch: ``op`` "isend" / "irecv" or those functions, ``peer`` a global rank."""

    def __init__(self, op, tensor, peer, group=None, tag=0):
        if op in ("isend", isend):
            self.op = "isend"
        elif op in ("irecv", irecv):
            self.op = "irecv"
        else:
            raise TypeError("op must be 'isend' / 'irecv' or distributed.isend / distributed.irecv")
        if not isinstance(tensor, Tensor) or not isinstance(peer, int):
            raise TypeError("tensor must be a Tensor and peer an int")
        if tag != 0:
            raise NotImplementedError("tag is not supported yet")
        self.tensor, self.peer, self.group, self.tag = tensor, peer, group, tag


def batch_isend_irecv(p2p_op_list):
    """Every isend's tensor reaches its peer's matching irecv tensor (in place); returns one handle."""
    if not p2p_op_list or not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise TypeError("p2p_op_list must be a non-empty list of P2POp")
    if len({p.group for p in p2p_op_list}) != 1:
        raise TypeError("The group name in p2p_op_list must be consistent.")
    group = _group(p2p_op_list[0].group)
    for p in p2p_op_list:
        if p.peer not in group.ranks:
            raise ValueError(f"peer {p.peer} is not a member of the P2POps' group {list(group.ranks)}")
    for p in p2p_op_list:
        if p.op == "isend":
            _deliver(p.tensor, p.peer, "batch_isend_irecv")
    for p in p2p_op_list:
        if p.op == "irecv":
            _collect(p.tensor, p.peer, "batch_isend_irecv")
    return [_Done()]


NAMES = ("new_group", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
         "broadcast", "barrier", "send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv")
