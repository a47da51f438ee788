"""Collective and region-map checks against numpy, run inside msrun workers.

Every rank draws the data of every rank from a seed (rank, case), so each rank computes the
numpy answer for its own group independently of the communication under test. A case returns
"" when it matches and a message otherwise; `run_cases` runs them all in one launch (one msrun
start costs seconds, one collective milliseconds).

Values are small integers, so sums are exact in every dtype and comparisons are exact except
where a division (avg) rounds.
"""

from __future__ import annotations

import time
import traceback
from typing import Dict, List, Tuple

import numpy as np
from helpers import hccl_stand_in_cases

# (group kind, layout): which groups the cases run on, per world size. tp=2 x cp=2 inside a
# world of 4 gives contiguous tp groups [0,1],[2,3] and strided cp groups [0,2],[1,3].
GROUPS = {
    2: [("world", {}), ("tp", {"tp": 2})],
    4: [("world", {}), ("tp", {"tp": 2, "cp": 2}), ("cp", {"tp": 2, "cp": 2}), ("dp", {"tp": 2, "cp": 2})],
}
REDUCE_DTYPES = ["float32", "float16", "bfloat16", "int8", "int16", "int32", "int64", "float64", "uint8", "bool"]
MOVE_DTYPES = ["float32", "float16", "bfloat16", "int8", "int16", "int32", "int64", "float64", "uint8", "bool"]
SHAPE = (4, 8, 4)
ALL_TO_ALL_DIMS = [(0, 1), (1, 0), (2, 1), (1, 1), (1, 2)]
MAPS = [
    "copy_to_region",
    "reduce_from_region",
    "scatter_to_region",
    "gather_from_region",
    "scatter_to_sequence",
    "gather_from_sequence",
    "gather_from_sequence_split_grad",
    "reduce_scatter_to_sequence",
    "all_to_all_1_2",
    "all_to_all_2_1",
]


def case_names(world_size: int) -> List[str]:
    names = []
    for kind, _ in GROUPS[world_size]:
        for dtype in REDUCE_DTYPES:
            for op in ("sum", "max", "min") if dtype != "bool" else ("sum",):
                names.append(f"{kind}/all_reduce/{op}/{dtype}")
        names.append(f"{kind}/all_reduce/avg/float32")
        for dtype in MOVE_DTYPES:
            for dim in (0, 1, 2):
                names.append(f"{kind}/all_gather/dim{dim}/{dtype}")
        for dim in (0, 1):
            for op in ("sum", "avg", "max"):
                names.append(f"{kind}/reduce_scatter/dim{dim}/{op}")
        for s, g in ALL_TO_ALL_DIMS:
            names.append(f"{kind}/all_to_all/{s}to{g}")
        names += [f"{kind}/all_to_all/int64", f"{kind}/broadcast/float32", f"{kind}/broadcast/bool"]
        names += [f"{kind}/all_to_all_v/{sizes}" for sizes in ("random", "empty", "known", "megabytes")]
        names += [f"{kind}/all_to_all_v/native_{sizes}" for sizes in ("random", "empty")]
        names += [f"{kind}/all_gather_bytes/{sizes}" for sizes in ("random", "empty", "one_empty")]
        names += [f"{kind}/ring_shift/{d}" for d in ("+1", "-1", "+2", "+3")] + [f"{kind}/barrier"]
        names += [f"{kind}/map/{m}" for m in MAPS]
        names += [f"{kind}/errors/not_divisible"]
    names += ["p2p/exchange_unequal_shapes", "p2p/send_recv", "p2p/send_recv_pipeline", "p2p/wide_integers"]
    # over 4 MB, all_gather and broadcast travel in pieces (comm/cpu.py): 5 MB and 9 MB per rank
    names += [f"world/{op}/large{mb}" for op in ("all_gather", "broadcast", "all_to_all") for mb in (5, 9)]
    return names


def _data(rank: int, case: str, shape=SHAPE, dtype="float32") -> np.ndarray:
    seed = [rank] + [ord(c) for c in case]
    values = np.random.default_rng(seed).integers(-8, 8, size=shape)
    if dtype == "bool":
        return values > 0
    if dtype == "uint8":
        return (values + 8).astype(np.uint8)
    return values.astype(np.float32 if dtype == "bfloat16" else dtype)


def _chunks(a: np.ndarray, n: int, dim: int) -> List[np.ndarray]:
    return np.split(a, n, axis=dim)


def _to_ms(a: np.ndarray, dtype: str):
    import mindspore as ms
    from mindspore import Tensor

    t = Tensor(a)
    return t.astype(ms.bfloat16) if dtype == "bfloat16" else t


def _to_np(t) -> np.ndarray:
    import mindspore as ms

    return t.astype(ms.float32).asnumpy() if t.dtype == ms.bfloat16 else t.asnumpy()


def _compare(got: np.ndarray, want: np.ndarray, rtol: float = 0.0, atol: float = 0.0) -> str:
    if got.shape != want.shape:
        return f"shape {got.shape} != expected {want.shape}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype} != expected {want.dtype}"
    try:
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol)
    except AssertionError as e:
        return str(e)
    return ""


_NP_REDUCE = {"sum": lambda s: s.sum(0), "max": lambda s: s.max(0), "min": lambda s: s.min(0)}


def _expected_reduce(stack: np.ndarray, op: str, dtype: str) -> np.ndarray:
    if dtype == "bool":
        return stack.any(0)
    if op == "avg":
        return stack.sum(0) / stack.shape[0]
    return _NP_REDUCE[op](stack).astype(stack.dtype)


def _run_all_gather_bytes(sizes: str, group, name: str) -> str:
    """Byte strings of different lengths (0 bytes for every rank, or for group rank 0 only), with
    zero bytes inside and at the end (the padding must not eat them)."""
    from mm_parallel import comm

    def data(index: int) -> bytes:
        length = 0 if sizes == "empty" or (sizes == "one_empty" and index == 0) else 3 + 37 * index
        values = np.random.default_rng([index] + [ord(c) for c in name]).integers(0, 4, length)
        return values.astype(np.uint8).tobytes() + (b"\0\0" if length else b"")

    want = [data(i) for i in range(group.size)]
    got = comm.all_gather_bytes(data(group.rank), group)
    return "" if got == want else f"got lengths {[len(g) for g in got]}, want {[len(w) for w in want]} or other bytes"


def _run_case(name: str, topo) -> str:

    from mm_parallel import comm

    parts = name.split("/")
    kind, what = parts[0], parts[1]
    if kind == "p2p":
        return _run_p2p(what, topo)
    group = getattr(topo, kind) if kind != "world" else topo.world
    n, me = group.size, group.rank
    xs = [_data(r, name) for r in group.ranks]

    if what == "all_reduce":
        op, dtype = parts[2], parts[3]
        xs = [_data(r, name, dtype=dtype) for r in group.ranks]
        got = _to_np(comm.all_reduce(_to_ms(xs[me], dtype), group, op))
        want = _expected_reduce(np.stack(xs), op, dtype)
        return _compare(got, want, rtol=1e-6 if op == "avg" else 0.0)
    if len(parts) > 2 and parts[2].startswith("large"):
        return _run_large(what, int(parts[2][5:]), group, name)
    if what == "all_gather":
        dim, dtype = int(parts[2][3:]), parts[3]
        xs = [_data(r, name, dtype=dtype) for r in group.ranks]
        got = _to_np(comm.all_gather(_to_ms(xs[me], dtype), group, dim))
        return _compare(got, np.concatenate(xs, axis=dim))
    if what == "all_gather_bytes":
        return _run_all_gather_bytes(parts[2], group, name)
    if what == "reduce_scatter":
        dim, op = int(parts[2][3:]), parts[3]
        got = _to_np(comm.reduce_scatter(_to_ms(xs[me], "float32"), group, dim, op))
        want = _chunks(_expected_reduce(np.stack(xs), op, "float32"), n, dim)[me]
        return _compare(got, want, rtol=1e-6)
    if what == "all_to_all":
        s, g = (0, 0) if parts[2] == "int64" else map(int, parts[2].split("to"))
        if parts[2] == "int64":
            xs = [_data(r, name, dtype="int64") for r in group.ranks]
        got = _to_np(comm.all_to_all(_to_ms(xs[me], "float32"), group, s, g))
        want = np.concatenate([_chunks(x, n, s)[me] for x in xs], axis=g)
        return _compare(got, want)
    if what == "all_to_all_v":
        return _run_all_to_all_v(parts[2], group)
    if what == "broadcast":
        dtype = parts[2]
        xs = [_data(r, name, dtype=dtype) for r in group.ranks]
        problems = []
        for src_index, src in enumerate(group.ranks):
            got = _to_np(comm.broadcast(_to_ms(xs[me], dtype), src, group))
            problems.append(_compare(got, xs[src_index]))
        return "; ".join(p for p in problems if p)
    if what == "ring_shift":
        offset = int(parts[2])
        got = _to_np(comm.ring_shift(_to_ms(xs[me], "float32"), group, offset))
        return _compare(got, xs[(me - offset) % n])
    if what == "barrier":
        return _run_barrier(group, me)
    if what == "map":
        return _run_map(parts[2], group, xs, name)
    if what == "errors":
        return _run_errors(group)
    raise KeyError(name)


LATE_SECONDS = 0.5


def _run_barrier(group, me: int) -> str:
    """The group's last member arrives LATE_SECONDS after the others: nobody may leave before it
    (the first barrier lines the members up; the second is the one measured)."""
    from mm_parallel import comm

    comm.barrier(group)
    if me == group.size - 1:
        time.sleep(LATE_SECONDS)
    start = time.perf_counter()
    comm.barrier(group)
    waited = time.perf_counter() - start
    if me != group.size - 1 and waited < 0.8 * LATE_SECONDS:
        return f"member {me} left the barrier after {waited:.3f} s, before the last one arrived ({LATE_SECONDS} s)"
    return ""


def _run_all_to_all_v(which: str, group) -> str:
    """sizes[j, k] rows from rank j to rank k, the same matrix on every rank; "empty": rank 0
    receives nothing and rank 1 sends nothing; "known": the whole matrix passed (no size exchange);
    "megabytes": rows of ~1 MB, so more than two ranks go pairwise (comm/cpu.py)."""
    from mindspore import Tensor

    from mm_parallel import comm

    n, me = group.size, group.rank
    native = which.startswith("native_")
    which = which[len("native_"):] if native else which
    sizes = np.random.default_rng(len(which) + n).integers(0, 4, (n, n))
    if which == "empty":
        sizes[:, 0] = 0
        sizes[min(1, n - 1), :] = 0
    width = 2 ** 18 + 3 if which == "megabytes" else 3
    xs = [np.random.default_rng([j, 7]).standard_normal((int(sizes[j].sum()), width)).astype(np.float32)
          for j in range(n)]
    want = [xs[j][sizes[j, :me].sum():sizes[j, :me + 1].sum()] for j in range(n)]
    if native:
        got = _native_all_to_all_v(Tensor(xs[me]), group, sizes[me].tolist(), sizes[:, me].tolist())
    else:
        got = comm.all_to_all_v(Tensor(xs[me]), group, sizes[me].tolist(), sizes[:, me].tolist(),
                                sizes.tolist() if which == "known" else None)
    return _compare(got.asnumpy().reshape(-1, width), np.concatenate(want))


def _native_all_to_all_v(x, group, send_sizes, recv_sizes):
    """The native (HCCL) backend's all_to_all_v on the stand-in of mint.distributed.all_to_all_single
    (mm_parallel.testing.hccl: numpy on the members' rows, moved by files)."""
    from mm_parallel.comm.native import NativeBackend
    from mm_parallel.testing import hccl

    if group.size == 1:  # comm.all_to_all_v never calls a backend for a group of one
        return x
    return NativeBackend(hccl).all_to_all_v(x, group, send_sizes, recv_sizes)


def _run_large(what: str, megabytes: int, group, name) -> str:
    """A tensor larger than one mccl message: (n*k, 2^18 + 3) float32 rows of ~1 MB."""
    from mindspore import Tensor

    from mm_parallel import comm

    n, me = group.size, group.rank
    shape = (megabytes if megabytes % n == 0 else megabytes * n, (1 << 18) + 3)
    xs = [np.random.default_rng([r, megabytes]).standard_normal(shape).astype(np.float32) for r in group.ranks]
    if what == "all_gather":
        return _compare(comm.all_gather(Tensor(xs[me]), group, 1).asnumpy(), np.concatenate(xs, axis=1))
    if what == "broadcast":
        src = group.ranks[-1]
        return _compare(comm.broadcast(Tensor(xs[me]), src, group).asnumpy(), xs[-1])
    want = np.concatenate([_chunks(x, n, 0)[me] for x in xs], axis=1)
    return _compare(comm.all_to_all(Tensor(xs[me]), group, 0, 1).asnumpy(), want)


def _run_map(which: str, group, xs, name) -> str:
    """Forward and backward of one region map; the cotangent c_r differs per rank."""
    import mindspore as ms

    from mm_parallel import mappings

    n, me = group.size, group.rank
    dim_tp, dim_seq = -1, 1
    x = xs[me]

    if which == "copy_to_region":
        fn = lambda t: mappings.copy_to_region(t, group)
        y_want = x
        cs = [_data(r + 100, name, y_want.shape) for r in group.ranks]
        dx_want = sum(cs)
    elif which == "reduce_from_region":
        fn = lambda t: mappings.reduce_from_region(t, group)
        y_want = sum(xs)
        cs = [_data(r + 100, name, y_want.shape) for r in group.ranks]
        dx_want = cs[me]
    elif which in ("scatter_to_region", "scatter_to_sequence"):
        dim = dim_tp if which == "scatter_to_region" else dim_seq
        # the input of a scatter is replicated; take rank 0's
        x = xs[0]
        fn = (lambda t: mappings.scatter_to_region(t, group, dim)) if dim == dim_tp else (
            lambda t: mappings.scatter_to_sequence(t, group, dim))
        if x.shape[dim] % n:
            x = np.concatenate([x] * n, axis=dim)
        y_want = _chunks(x, n, dim)[me]
        cs = [_data(r + 100, name, y_want.shape) for r in group.ranks]
        dx_want = np.concatenate(cs, axis=dim)
    elif which == "gather_from_region":
        fn = lambda t: mappings.gather_from_region(t, group, dim_tp)
        y_want = np.concatenate(xs, axis=dim_tp)
        c = _data(100, name, y_want.shape)  # the gathered output is replicated, so is its cotangent
        cs = [c] * n
        dx_want = _chunks(c, n, dim_tp)[me]
    elif which in ("gather_from_sequence", "gather_from_sequence_split_grad"):
        split = which.endswith("split_grad")
        fn = lambda t: mappings.gather_from_sequence(t, group, dim_seq, grad_reduce_scatter=not split)
        y_want = np.concatenate(xs, axis=dim_seq)
        cs = [_data(r + 100, name, y_want.shape) for r in group.ranks]
        dx_want = _chunks(cs[me] if split else sum(cs), n, dim_seq)[me]
    elif which == "reduce_scatter_to_sequence":
        fn = lambda t: mappings.reduce_scatter_to_sequence(t, group, dim_seq)
        y_want = _chunks(sum(xs), n, dim_seq)[me]
        cs = [_data(r + 100, name, y_want.shape) for r in group.ranks]
        dx_want = np.concatenate(cs, axis=dim_seq)
    elif which.startswith("all_to_all"):
        s, g = map(int, which.split("_")[-2:])
        fn = lambda t: mappings.all_to_all(t, group, s, g)
        y_want = np.concatenate([_chunks(v, n, s)[me] for v in xs], axis=g)
        cs = [_data(r + 100, name, y_want.shape) for r in group.ranks]
        # the inverse all-to-all: rank me gets, from every rank j, chunk me of c_j along g, on s
        dx_want = np.concatenate([_chunks(c, n, g)[me] for c in cs], axis=s)
    else:
        raise KeyError(which)

    from mindspore import Tensor

    c_me = Tensor(cs[me].astype(np.float32))
    y = fn(Tensor(x))
    problem = _compare(y.asnumpy(), y_want.astype(np.float32))
    if problem:
        return "forward: " + problem
    dx = ms.grad(lambda t: (fn(t) * c_me).sum())(Tensor(x))
    problem = _compare(dx.asnumpy(), dx_want.astype(np.float32))
    return "backward: " + problem if problem else ""


def _run_errors(group) -> str:
    """Shapes that do not split raise ValueError on every rank before anything is sent."""
    from mindspore import Tensor

    from mm_parallel import comm, mappings

    if group.size == 1:
        return ""
    bad = Tensor(np.zeros((group.size + 1, 3), np.float32))
    calls = {
        "reduce_scatter": lambda: comm.reduce_scatter(bad, group, 0),
        "all_to_all": lambda: comm.all_to_all(bad, group, 0, 1),
        "scatter_to_sequence": lambda: mappings.scatter_to_sequence(bad, group, 0),
        "reduce_scatter_to_sequence": lambda: mappings.reduce_scatter_to_sequence(bad, group, 0),
        "bad_dim": lambda: comm.all_gather(bad, group, 5),
        "bad_op": lambda: comm.all_reduce(bad, group, "prod"),
    }
    missing = []
    for what, call in calls.items():
        try:
            call()
            missing.append(what)
        except ValueError as e:
            if what != "bad_op" and what != "bad_dim" and "equal parts" not in str(e):
                missing.append(f"{what} (message: {e})")
    return f"no ValueError from {missing}" if missing else ""


def _run_p2p(what: str, topo) -> str:
    import mindspore as ms
    from mindspore import Tensor

    from mm_parallel import comm

    me, world = topo.rank, topo.world_size
    if what == "exchange_unequal_shapes":
        # pairs (0,1), (2,3): each side sends a tensor of length rank+1, a pipeline's micro-batches
        peer = me ^ 1
        got = comm.exchange(Tensor(_data(me, what, (me + 1, 3))), peer, recv_shape=(peer + 1, 3)).asnumpy()
        return _compare(got, _data(peer, what, (peer + 1, 3)))
    if what == "send_recv":
        # the first rank sends to the last, which receives; the others do not take part
        first, last = 0, world - 1
        if me == first:
            comm.send(Tensor(_data(first, what)), last)
        elif me == last:
            return _compare(comm.recv(SHAPE, ms.float32, first).asnumpy(), _data(first, what))
        return ""
    if what == "send_recv_pipeline":
        # a forward pass through a pipeline of all ranks: 0 -> 1 -> ... -> last, adding one each hop
        value = Tensor(_data(0, what)) if me == 0 else comm.recv(SHAPE, ms.float32, me - 1) + 1
        if me < world - 1:
            comm.send(value, me + 1)
            return ""
        return _compare(value.asnumpy(), _data(0, what) + (world - 1))
    if what == "wide_integers":
        # int32 / int64 beyond float32's 24-bit mantissa arrive exactly (mccl rounds them through
        # float32 in all_reduce and broadcast: comm/cpu.py sends them by all_gather)
        problems = []
        for dtype, np_dtype in ((ms.int64, np.int64), (ms.int32, np.int32)):
            length = 4 if dtype == ms.int64 else 3
            wide = _wide(me, np_dtype, length)
            summed = comm.all_reduce(Tensor(wide, dtype), topo.world).asnumpy()
            want = np.sum([_wide(r, np_dtype, length) for r in range(world)], axis=0, dtype=np_dtype)
            problems.append(_compare(summed, want))
            first = _wide(0, np_dtype, length)
            problems.append(_compare(comm.broadcast(Tensor(wide, dtype), 0, topo.world).asnumpy(), first))
            if me == 0:
                comm.send(Tensor(wide, dtype), world - 1)
            elif me == world - 1:
                problems.append(_compare(comm.recv(wide.shape, dtype, 0).asnumpy(), first))
        return "; ".join(p for p in problems if p)
    raise KeyError(what)


def _wide(rank: int, dtype, length: int) -> np.ndarray:
    values = [2 ** 24 + 1 + rank, 2 ** 31 - 1 - rank, -(2 ** 30) - 3, 2 ** 40 + 7 + rank]
    return np.array(values[:length], dtype)


NATIVE_DTYPES = ("float32", "bfloat16", "float16", "int32", "int64")


def native_case_names(world_size: int) -> List[str]:
    """The cases the native (HCCL) backend runs on its stand-ins: every op, map and group kind, in
    the dtypes training moves (float32, bfloat16, float16, int32, int64; HCCL's own dtype list is
    wider than mccl's, whose gaps the CPU backend's carriers fill), and one message over 16 MiB."""
    def wanted(name):
        last = name.split("/")[-1]
        return "large" not in last and (last not in REDUCE_DTYPES or last in NATIVE_DTYPES)

    return ([name for name in case_names(world_size) if wanted(name)] + ["world/broadcast/large20"]
            + hccl_stand_in_cases.names())


def run_cases(world_size: int, native: bool = False) -> Dict[str, str]:
    """Every case for this world size; returns {case: "" or what went wrong} for this rank.
    ``native``: `native_case_names` through the native backend on its stand-ins
    (mm_parallel.testing.device_path)."""
    if native:
        from mm_parallel.testing.device_path import ascend_stand_ins

        with ascend_stand_ins():
            results = _run_named(world_size, native_case_names(world_size))
        return {**results, **hccl_stand_in_cases.run()}
    return _run_named(world_size, case_names(world_size))


def _run_named(world_size: int, names: List[str]) -> Dict[str, str]:
    import mm_parallel

    results: Dict[str, str] = {}
    layouts: Dict[Tuple, object] = {}
    for kind, layout in GROUPS[world_size]:
        key = tuple(sorted(layout.items()))
        if key not in layouts:
            layouts[key] = mm_parallel.initialize(mm_parallel.ParallelConfig(**layout))
        topo = layouts[key]
        for name in names:
            if name.split("/")[0] == kind:
                results[name] = _guarded(name, topo)
    topo = mm_parallel.initialize(mm_parallel.ParallelConfig())
    for name in names:
        if name.startswith("p2p/"):
            results[name] = _guarded(name, topo)
    return results


def _guarded(name, topo) -> str:
    try:
        return _run_case(name, topo)
    except Exception:
        return traceback.format_exc()
