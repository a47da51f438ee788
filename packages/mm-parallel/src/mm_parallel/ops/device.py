"""Which kernels to use: fused Ascend kernels on Ascend, the CPU reference path elsewhere.

``MM_KERNELS=reference`` (read once, at import) forces the reference path on any device (to
compare the two on Ascend); `set_kernels` overrides the choice in code (``mm_parallel.testing``
forces the fused path on CPU, with documented-semantics stand-ins for the Ascend calls).
"""

import functools
import os
from typing import Optional

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

_FORCE_REFERENCE = os.environ.get("MM_KERNELS") == "reference"  # read once, when mm_parallel loads


_KERNELS = {"choice": None}  # None: by device; "fused" / "reference": forced


def set_kernels(choice: Optional[str]) -> None:
    """Force the fused (``"fused"``) or reference (``"reference"``) kernels; None chooses by device."""
    if choice not in (None, "fused", "reference"):
        raise ValueError(f"kernels {choice!r} is unknown; use 'fused', 'reference' or None (by device)")
    _KERNELS["choice"] = choice


def use_fused() -> bool:
    """Fused Ascend kernels: on Ascend unless MM_KERNELS=reference was set at start-up (or
    `set_kernels` forced a choice)."""
    if _KERNELS["choice"] is not None:
        return _KERNELS["choice"] == "fused"
    return not _FORCE_REFERENCE and ms.get_context("device_target") == "Ascend"


def host_array(x, dtype=None) -> Optional[np.ndarray]:
    """A Tensor's (or array-like's) values as a numpy array on the host; None stays None (an
    optional input: masks, grids)."""
    if x is None:
        return None
    return np.asarray(x.asnumpy() if isinstance(x, Tensor) else x, dtype=dtype)


def as_type(x, dtype):
    """x in ``dtype``, without the copy ``astype`` makes when x already has it (0.75 ms per call on
    a 2048 x 512 float32 activation, ~150 calls in a Wan forward)."""
    return x if x.dtype == dtype else x.astype(dtype)


def zeros(shape, dtype=ms.float32):
    """A new tensor of zeros in any dtype (ops.zeros has no CPU kernel for bfloat16)."""
    return Tensor(np.zeros(tuple(shape), np.float32), dtype)


def with_zero_row(rows, like=None):
    """``rows`` (n, ...) with one row of zeros appended along dim 0; with n = 0 just that row
    (``like`` then gives its shape and dtype). MoE token buffers end in such a row: padding and
    dropped slots point at it, and MindSpore's autodiff fails on empty tensors (DESIGN §4)."""
    like = rows if like is None else like
    zero = zeros((1,) + tuple(like.shape[1:]), like.dtype)
    return ops.concat([rows, zero], 0) if rows.shape[0] else zero


@functools.lru_cache(maxsize=256)
def ones(shape, dtype=ms.float32):
    """A tensor of ones, made once per (shape, dtype): the right operand of the row-sum matmuls
    the CPU path uses for reductions. ops.ones is an op of its own (50-130 us on CPU) per call."""
    return Tensor(np.ones(shape, np.float32), dtype)


_batch_matmul = ops.BatchMatMul()


class _TiledTo(nn.Cell):
    """ops.tile up to a shape, whose gradient (a sum over the repeated dims) is a matmul with ones
    when the repeated dims are adjacent: (pre, T, post) -> ones(1, T) @ . per pre. MindSpore's
    own tile gradient is a ReduceSum, 2-3x slower on CPU (7-18 ms per call in a Wan step)."""

    def construct(self, x, shape):
        return ops.tile(x, tuple(n // m for n, m in zip(shape, x.shape)))

    def bprop(self, x, shape, out, dout):
        dims = [i for i, (m, n) in enumerate(zip(x.shape, shape)) if m == 1 and n > 1]
        if not dims:
            return dout, ()
        if dims != list(range(dims[0], dims[-1] + 1)):
            return dout.sum(tuple(dims), keepdims=True), ()
        pre, repeated = int(np.prod(shape[:dims[0]])), int(np.prod(shape[dims[0]:dims[-1] + 1]))
        post = int(np.prod(shape[dims[-1] + 1:]))
        if pre == 1:
            dx = ops.matmul(ones((1, repeated), dout.dtype), dout.reshape(repeated, post))
        else:
            dx = _batch_matmul(ones((pre, 1, repeated), dout.dtype), dout.reshape(pre, repeated, post))
        return dx.reshape(x.shape), ()


_tiled_to = _TiledTo()


def tiled_to(x, shape):
    """``x`` repeated up to ``shape`` along its size-one dims (same number of dims).

    MindSpore's CPU kernels run broadcasting elementwise ops ~10x slower than same-shape ones
    (measured on 8M floats: 95 ms against 9 ms) while tile is cheap, so the reference path tiles
    masks, row statistics and rotary tables before combining them with big tensors.
    """
    shape = tuple(shape)
    if tuple(x.shape) == shape:
        return x
    return _tiled_to(x, shape)
