"""Grouped matmul: rows of x cut into consecutive groups, group e multiplied by weight e.

    y[g_{e-1}:g_e] = x[g_{e-1}:g_e] W_e^T        W (E, N, K), x (M, K), g = cumsum(counts), g_{-1} = 0

On Ascend this is the fused ``grouped_matmul`` kernel (one TensorList each, ``split_item=3``,
``group_type=0``: the mode MindSpore differentiates; ``group_list`` the cumulative row counts,
int64). Elsewhere `mm_parallel.moe.GroupedExperts` pads the groups into one batched matmul
instead (measured faster on CPU than a loop, benchmarks/moe.py), so this entry is Ascend's only.
The kernel's page lists float16 and float32 operands only: bfloat16 ones are multiplied in
float32 (exact products of bf16 values, fp32 sums as the Cube unit keeps) and the result rounded
back to bfloat16.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor

_KERNEL_DTYPES = (ms.float16, ms.float32)


def _fused_kernel(x, weight, group_list):
    from mindspore.ops.auto_generate import grouped_matmul

    return grouped_matmul([x], [weight], group_list=group_list, split_item=3, group_type=0, transpose_b=True)[0]


def grouped_matmul(x, weight, counts: np.ndarray):
    """(sum(counts), N): group e (``counts[e]`` consecutive rows of x) times weight[e]^T."""
    if int(np.sum(counts)) != x.shape[0]:
        raise ValueError(f"grouped_matmul: counts {list(counts)} add up to {int(np.sum(counts))} rows, "
                         f"x has {x.shape[0]}")
    group_list = Tensor(np.cumsum(counts).astype(np.int64))
    if x.dtype in _KERNEL_DTYPES and weight.dtype == x.dtype:
        return _fused_kernel(x, weight, group_list)
    return _fused_kernel(x.astype(ms.float32), weight.astype(ms.float32), group_list).astype(x.dtype)


def padded_slots(counts: np.ndarray, width: int) -> np.ndarray:
    """(E, width): for rows grouped by expert (``counts[e]`` consecutive rows of expert e), the row
    each slot of an expert's padded block takes; padding slots take row ``counts.sum()`` (a zero
    row the caller appends)."""
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    slots = np.full((len(counts), width), int(np.sum(counts)), np.int64)
    for e, (start, count) in enumerate(zip(starts, counts)):
        slots[e, :count] = start + np.arange(count)
    return slots
