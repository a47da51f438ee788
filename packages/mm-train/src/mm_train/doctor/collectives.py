"""The doctor's collective checks, run on every msrun worker: each collective of mm_parallel.comm
on each group kind of a small layout, against numpy.

Every rank draws every rank's data from a seed (rank, check), so it computes the numpy answer for
its own group without communicating. Values are small integers: sums are exact in every dtype.
Layouts: 2 processes: the world and tp2; 4 or more (even): tp2 x cp2 gives contiguous tp groups
and strided cp groups, the rest dp. Returns {check: {"ok", "seconds", "error"}} per rank.
"""

from __future__ import annotations

import time
import traceback
from typing import Callable, Dict, List, Tuple

import numpy as np

# Deferred imports: MindSpore and mm-parallel (the CLI starts without loading MindSpore).

SHAPE = (4, 8, 4)


def layouts(world: int) -> List[Tuple[str, dict]]:
    """(group kind, layout) pairs the checks run on for a world of ``world`` processes."""
    if world >= 4 and world % 4 == 0:
        layout = {"tp": 2, "cp": 2}
        return [("world", {}), ("tp", layout), ("cp", layout), ("dp", layout)]
    if world % 2 == 0:
        return [("world", {}), ("tp", {"tp": 2})]
    return [("world", {})]


def _data(rank: int, name: str, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng([rank] + [ord(c) for c in name]).integers(-8, 8, SHAPE).astype(dtype)


def _checks() -> Dict[str, Callable]:
    """check name -> fn(group, name) returning (got, want) numpy arrays for this rank."""
    import mindspore as ms
    from mindspore import Tensor

    from mm_parallel import comm

    def mine(group, name, dtype=np.float32):
        return Tensor(_data(group.ranks[group.rank], name, dtype))

    def every(group, name, dtype=np.float32):
        return [_data(r, name, dtype) for r in group.ranks]

    def bf16(group, name):
        got = comm.all_reduce(mine(group, name).astype(ms.bfloat16), group).astype(ms.float32).asnumpy()
        return got, np.sum(every(group, name), 0)

    return {
        "all_reduce sum float32": lambda g, n: (comm.all_reduce(mine(g, n), g).asnumpy(), np.sum(every(g, n), 0)),
        "all_reduce max float32": lambda g, n: (comm.all_reduce(mine(g, n), g, "max").asnumpy(),
                                                np.max(every(g, n), 0)),
        "all_reduce sum bfloat16": bf16,
        "all_reduce sum int64": lambda g, n: (comm.all_reduce(mine(g, n, np.int64), g).asnumpy(),
                                              np.sum(every(g, n, np.int64), 0)),
        "all_gather dim 1": lambda g, n: (comm.all_gather(mine(g, n), g, 1).asnumpy(),
                                          np.concatenate(every(g, n), 1)),
        "reduce_scatter dim 0": lambda g, n: (comm.reduce_scatter(mine(g, n), g, 0).asnumpy(),
                                              np.split(np.sum(every(g, n), 0), g.size, 0)[g.rank]),
        "all_to_all 1 -> 2": lambda g, n: (comm.all_to_all(mine(g, n), g, 1, 2).asnumpy(),
                                           np.concatenate([np.split(x, g.size, 1)[g.rank] for x in every(g, n)], 2)),
        "broadcast": lambda g, n: (comm.broadcast(mine(g, n), g.ranks[-1], g).asnumpy(), every(g, n)[-1]),
        "ring_shift +1": lambda g, n: (comm.ring_shift(mine(g, n), g, 1).asnumpy(), every(g, n)[(g.rank - 1) % g.size]),
        "all_to_all_v": _all_to_all_v,
    }


def _all_to_all_v(group, name):
    """Rank j sends (j + k) % 3 rows to rank k (some pieces empty)."""
    from mindspore import Tensor

    from mm_parallel import comm

    n = group.size
    sizes = [[(j + k) % 3 for k in range(n)] for j in range(n)]
    rows = [np.random.default_rng([group.ranks[j], 7]).integers(-8, 8, (sum(sizes[j]), 3)).astype(np.float32)
            for j in range(n)]
    me = group.rank
    got = comm.all_to_all_v(Tensor(rows[me]), group, sizes[me], [sizes[j][me] for j in range(n)]).asnumpy()
    want = np.concatenate([rows[j][sum(sizes[j][:me]):sum(sizes[j][:me + 1])] for j in range(n)], 0)
    return got, want


def _timed(fn) -> dict:
    start = time.perf_counter()
    try:
        got, want = fn()
        ok = got.shape == want.shape and np.array_equal(got, want)
        error = "" if ok else f"got {got.shape} {got.ravel()[:4]} ..., numpy gives {want.shape} {want.ravel()[:4]} ..."
    except Exception:  # noqa: BLE001 - reported per check
        ok, error = False, traceback.format_exc(limit=3)
    return {"ok": ok, "seconds": round(time.perf_counter() - start, 4), "error": error}


def run_checks(world: int) -> Dict[str, dict]:
    """Every check on every group kind (msrun worker entry); plus a pipeline exchange of pairs."""
    from mindspore import Tensor

    import mm_parallel
    from mm_parallel import comm

    results = {}
    checks = _checks()
    for kind, layout in layouts(world):
        topo = mm_parallel.initialize(mm_parallel.ParallelConfig(**layout))
        group = getattr(topo, kind) if kind != "world" else topo.world
        for name, fn in checks.items():
            results[f"{kind}: {name}"] = _timed(lambda: fn(group, name))
    topo = mm_parallel.initialize(mm_parallel.ParallelConfig())
    peer = topo.rank ^ 1
    if peer < world:
        results["pairs: exchange (pipeline p2p)"] = _timed(
            lambda: (comm.exchange(Tensor(_data(topo.rank, "p2p")), peer).asnumpy(), _data(peer, "p2p")))
    return results
