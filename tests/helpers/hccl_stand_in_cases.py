"""The HCCL stand-ins themselves (mm_parallel.testing.hccl), called directly inside msrun workers:
each documented call in the dtypes training moves, against numpy on every member's data (drawn
from a seed by every rank), and each refusal of what the pages forbid.

A case returns "" when it holds and what went wrong otherwise; they ride in the collective
cases' native launch (collective_cases.run_cases).
"""

from __future__ import annotations

import traceback
from typing import Callable, Dict, List

import numpy as np

DTYPES = ("float32", "bfloat16", "float16", "int32", "int64")
CALLS = ("all_reduce_sum", "all_reduce_max", "all_gather_into_tensor", "reduce_scatter_tensor",
         "all_to_all_single", "broadcast", "batch_isend_irecv", "send_recv")
REFUSALS = ("reduce_float64", "reduce_uint8", "prod_bfloat16", "gather_bool", "op_avg", "output_is_input",
            "split_not_divisible", "split_wrong_length", "split_counts_disagree", "shapes_disagree",
            "different_calls", "send_to_self", "receive_wrong_shape")


def names() -> List[str]:
    return [f"hccl/{call}/{dtype}" for call in CALLS for dtype in DTYPES] + [f"hccl/refuses/{r}" for r in REFUSALS]


def _values(rank: int, case: str, shape, dtype: str) -> np.ndarray:
    """Small integers (exact in every dtype); bfloat16 ones held as float32."""
    values = np.random.default_rng([rank] + [ord(c) for c in case]).integers(-8, 8, size=shape)
    return values.astype(np.float32 if dtype == "bfloat16" else dtype)


def _tensor(a: np.ndarray, dtype: str):
    import mindspore as ms
    from mindspore import Tensor

    return Tensor(a).astype(ms.bfloat16) if dtype == "bfloat16" else Tensor(a)


def _host(t) -> np.ndarray:
    import mindspore as ms

    return t.astype(ms.float32).asnumpy() if t.dtype == ms.bfloat16 else t.asnumpy()


def _same(got, want: np.ndarray) -> str:
    got = _host(got)
    if got.shape != want.shape or not np.array_equal(got.astype(np.float64), want.astype(np.float64)):
        return f"got {got.ravel()[:6]} {got.shape}, want {want.ravel()[:6]} {want.shape}"
    return ""


def _call(call: str, dtype: str, case: str) -> str:
    from mindspore.communication import get_group_size, get_rank

    from mm_parallel.testing import hccl

    n, me = get_group_size(), get_rank()
    shape = (2 * n, 3)
    xs = [_values(r, case, shape, dtype) for r in range(n)]
    out = _tensor(np.zeros(shape, xs[0].dtype), dtype)
    if call.startswith("all_reduce"):
        op = call.split("_")[-1]
        mine = _tensor(xs[me], dtype)
        hccl.all_reduce(mine, op=op)
        return _same(mine, getattr(np, op)(np.stack(xs), axis=0))
    if call == "all_gather_into_tensor":
        out = _tensor(np.zeros((2 * n * n, 3), xs[0].dtype), dtype)
        hccl.all_gather_into_tensor(out, _tensor(xs[me], dtype))
        return _same(out, np.concatenate(xs))
    if call == "reduce_scatter_tensor":
        out = _tensor(np.zeros((2, 3), xs[0].dtype), dtype)
        hccl.reduce_scatter_tensor(out, _tensor(xs[me], dtype))
        return _same(out, np.sum(xs, axis=0)[2 * me: 2 * me + 2])
    if call == "all_to_all_single":
        # rank r sends (r + k) % 3 rows to rank k: uneven, some empty
        sends = [[(r + k) % 3 for k in range(n)] for r in range(n)]
        rows = [_values(r, case, (sum(sends[r]), 3), dtype) for r in range(n)]
        recv = [sends[r][me] for r in range(n)]
        out = _tensor(np.zeros((sum(recv), 3), rows[0].dtype), dtype)
        hccl.all_to_all_single(out, _tensor(rows[me], dtype), recv, sends[me])
        want = [rows[r][sum(sends[r][:me]): sum(sends[r][:me + 1])] for r in range(n)]
        return _same(out, np.concatenate(want))
    if call == "broadcast":
        mine = _tensor(xs[me], dtype)
        hccl.broadcast(mine, n - 1)
        return _same(mine, xs[n - 1])
    if call == "batch_isend_irecv":  # a ring: to the next rank, from the previous
        ops = [hccl.P2POp("isend", _tensor(xs[me], dtype), (me + 1) % n),
               hccl.P2POp(hccl.irecv, out, (me - 1) % n)]
        hccl.batch_isend_irecv(ops)
        return _same(out, xs[(me - 1) % n])
    if me == 0:  # send_recv: rank 0 to the last rank
        hccl.send(_tensor(xs[0], dtype), dst=n - 1)
    elif me == n - 1:
        hccl.recv(out, src=0)
        return _same(out, xs[0])
    return ""


def _refusal(what: str) -> Callable[[], None]:
    """The call the stand-in must refuse (on every rank, so that no rank waits for another)."""
    import mindspore as ms
    from mindspore import Tensor
    from mindspore.communication import get_group_size, get_rank

    from mm_parallel.testing import hccl

    n, me = get_group_size(), get_rank()
    x = Tensor(np.ones((2 * n, 3), np.float32))
    return {
        "reduce_float64": lambda: hccl.all_reduce(Tensor(np.ones(3, np.float64))),
        "reduce_uint8": lambda: hccl.all_reduce(Tensor(np.ones(3, np.uint8))),
        "prod_bfloat16": lambda: hccl.all_reduce(x.astype(ms.bfloat16), op="prod"),
        "gather_bool": lambda: hccl.all_gather_into_tensor(Tensor(np.ones((2 * n * n, 3), bool)),
                                                           Tensor(np.ones((2 * n, 3), bool))),
        "op_avg": lambda: hccl.all_reduce(x, op="avg"),
        "output_is_input": lambda: hccl.all_to_all_single(x, x),
        "split_not_divisible": lambda: hccl.all_to_all_single(Tensor(np.ones((2 * n + 1, 3), np.float32)),
                                                              Tensor(np.ones((2 * n + 1, 3), np.float32))),
        "split_wrong_length": lambda: hccl.all_to_all_single(Tensor(np.ones((2, 3), np.float32)), x,
                                                             [2], [2 * n]),
        # every rank sends 2 rows to each, but rank 0 expects 3 from rank 1 and 1 from itself
        "split_counts_disagree": lambda: hccl.all_to_all_single(
            Tensor(np.ones((2 * n, 3), np.float32)), x, [1, 3] + [2] * (n - 2) if me == 0 else [2] * n, [2] * n),
        "shapes_disagree": lambda: hccl.all_reduce(Tensor(np.ones(3 + me, np.float32))),
        "different_calls": lambda: (hccl.all_reduce(Tensor(np.ones(3, np.float32))) if me == 0
                                    else hccl.broadcast(Tensor(np.ones(3, np.float32)), 0)),
        "send_to_self": lambda: hccl.send(x, dst=me),
        "receive_wrong_shape": lambda: (hccl.batch_isend_irecv([
            hccl.P2POp("isend", Tensor(np.ones((2, 3 + me), np.float32)), (me + 1) % n),
            hccl.P2POp("irecv", Tensor(np.zeros((2, 3), np.float32)), (me - 1) % n)])),
    }[what]


# what each refusal's message names (the quoted line's key words, or the detail)
_REASONS = {"reduce_float64": "bfp16", "reduce_uint8": "bfp16", "prod_bfloat16": "prod", "gather_bool": "uint64",
            "op_avg": "sum, prod, min, max", "output_is_input": "separate output",
            "split_not_divisible": "can not be divided", "split_wrong_length": "must be",
            "split_counts_disagree": "recvCounts", "shapes_disagree": "same shape",
            "different_calls": "in one order", "send_to_self": "same as the current process",
            "receive_wrong_shape": "need to match"}
# refusals that only some ranks see (the others' own view is consistent): rank -> refuses
_SEEN_BY = {"split_counts_disagree": lambda rank: rank == 0,  # only rank 0 expects other counts
            "receive_wrong_shape": lambda rank: rank != 1}  # rank 1 gets rank 0's (2, 3) rows


def _refused(what: str) -> str:
    from mindspore.communication import get_rank

    try:
        _refusal(what)()
    except (TypeError, ValueError, RuntimeError) as e:
        return "" if _REASONS[what] in str(e) else f"refused for another reason: {e}"
    return "" if what in _SEEN_BY and not _SEEN_BY[what](get_rank()) else "accepted"


def run() -> Dict[str, str]:
    results = {}
    for name in names():
        _, call, last = name.split("/")
        try:
            results[name] = _refused(last) if call == "refuses" else _call(call, last, name)
        except Exception:  # noqa: BLE001 - reported as the case's failure
            results[name] = traceback.format_exc()
    return results
