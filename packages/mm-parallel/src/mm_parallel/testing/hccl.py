"""Stand-ins for the HCCL calls of ``mindspore.mint.distributed`` that the native backend makes.

Each function has the signature of the MindSpore 2.7 call it replaces and its documented
semantics (https://www.mindspore.cn/docs/en/r2.7.2/api_python/mindspore.mint.html, the
"mindspore.mint.distributed" section; the docstrings of the installed mindspore 2.7.2 are the
same text): in-place results in the output tensor (and the receive tensors of batched p2p), the
shape rules each page states, ``peer`` / ``src`` / ``dst`` as global ranks, group names as
``new_group`` returns them. Underneath, the data moves by what MindSpore's CPU collectives can
do (mm_parallel.comm.cpu), so `mm_parallel.comm.native.NativeBackend` runs unchanged on CPU.

What the pages leave to the device (HCCL's own ordering of p2p operations) is replaced by
pairwise rounds: a batch of one isend and one irecv per rank, to and from one peer or around a
ring in the P2POps' group, is what the native backend issues.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from mindspore import Tensor

from mm_parallel.comm.cpu import CpuBackend
from mm_parallel.topology import Group

_STATE: Dict[str, object] = {"groups": {}, "fail_new_group": False}
_CPU: List[CpuBackend] = []


def _cpu() -> CpuBackend:
    if not _CPU:
        backend = CpuBackend()
        backend.init_world()
        _CPU.append(backend)
    return _CPU[0]


def _world() -> Tuple[int, int]:
    from mindspore.communication import get_group_size, get_rank

    return get_group_size(), get_rank()


def _group(name: Optional[str]) -> Group:
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


class _Done:
    """CommHandle of a finished operation (async_op=True)."""

    def wait(self):
        return True


def _handle(async_op):
    if not isinstance(async_op, bool):
        raise TypeError("async_op must be a bool")
    return _Done() if async_op else None


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
    _check_tensors(tensor=tensor)
    tensor.copy_(_cpu().all_reduce(tensor, _group(group), op))
    return _handle(async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """output (N x_1, x_2, ...) = the members' inputs (x_1, x_2, ...) stacked on dim 0."""
    _check_tensors(output_tensor=output_tensor, input_tensor=input_tensor)
    g = _group(group)
    want = (input_tensor.shape[0] * g.size,) + tuple(input_tensor.shape[1:])
    if tuple(output_tensor.shape) != want:
        raise ValueError(f"output_tensor must be {want} for {g.size} ranks, got {tuple(output_tensor.shape)}")
    output_tensor.copy_(_cpu().all_gather(input_tensor, g, 0))
    return _handle(async_op)


def reduce_scatter_tensor(output, input, op="sum", group=None, async_op=False):  # noqa: A002 - documented name
    """output (N / size, ...) = this member's chunk of the reduction of the inputs (N, ...)."""
    _check_tensors(output=output, input=input)
    if not isinstance(op, str):
        raise TypeError("op must be a str")
    g = _group(group)
    if input.shape[0] % g.size:
        raise ValueError(f"the first dimension {input.shape[0]} cannot be divided by the rank size {g.size}")
    want = (input.shape[0] // g.size,) + tuple(input.shape[1:])
    if tuple(output.shape) != want:
        raise ValueError(f"output must be {want}, got {tuple(output.shape)}")
    output.copy_(_cpu().reduce_scatter(input, g, 0, op))
    return _handle(async_op)


def _split_sizes(sizes, rows, size, what):
    if sizes is None or len(sizes) == 0:
        if rows % size:
            raise ValueError(f"{what} dim 0 ({rows}) can not be divided by world_size {size}")
        return [rows // size] * size
    sizes = [int(s) for s in sizes]
    if len(sizes) != size or sum(sizes) != rows:
        raise ValueError(f"{what} split sizes {sizes} must be {size} sizes adding up to {rows}")
    return sizes


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,  # noqa: A002
                      async_op=False):
    """Rows [sum(in[:k]), sum(in[:k+1])) of input go to member k; output stacks what member k
    sent here (output_split_sizes[k] rows) in member order."""
    _check_tensors(output=output, input=input)
    g = _group(group)
    send = _split_sizes(input_split_sizes, input.shape[0], g.size, "input")
    recv = _split_sizes(output_split_sizes, output.shape[0], g.size, "output")
    output.copy_(_cpu().all_to_all_v(input, g, send, recv))
    return _handle(async_op)


def broadcast(tensor, src, group=None, async_op=False):
    _check_tensors(tensor=tensor)
    tensor.copy_(_cpu().broadcast(tensor, src, _group(group)))
    return _handle(async_op)


def barrier(group=None, async_op=False, device_ids=None):
    _cpu().barrier(_group(group))
    return _handle(async_op)


def send(tensor, dst=0, group=None, tag=0):
    _check_tensors(tensor=tensor)
    _cpu().send(tensor, dst, _world()[1])


def recv(tensor, src=0, group=None, tag=0):
    _check_tensors(tensor=tensor)
    tensor.copy_(_cpu().recv(tuple(tensor.shape), tensor.dtype, src, _world()[1]))
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
        raise TypeError("the P2POps of one batch must use the same group")
    sends = [p for p in p2p_op_list if p.op == "isend"]
    recvs = [p for p in p2p_op_list if p.op == "irecv"]
    if len(sends) != 1 or len(recvs) != 1:
        raise NotImplementedError("the stand-in pairs one isend with one irecv per rank")
    out, x = recvs[0].tensor, sends[0].tensor
    dst, src, me = sends[0].peer, recvs[0].peer, _world()[1]
    if dst == src:
        out.copy_(_cpu().exchange(x, dst, me, tuple(out.shape)))
    else:
        if tuple(out.shape) != tuple(x.shape):
            raise NotImplementedError("a ring of p2p transfers needs one shape on every rank")
        out.copy_(_cpu().send_recv(x, dst, src, _group(sends[0].group), tuple(out.shape)))
    return [_Done()]


NAMES = ("new_group", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
         "broadcast", "barrier", "send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv")
