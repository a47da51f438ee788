"""Runtime settings mm-parallel needs for correct gradients.

Measured on MindSpore 2.7.2 CPU (PyNative, asynchronous op launch, the default): a Cell's custom
``bprop`` is sometimes skipped while the backward runs. A loop of 300 steps through four
identity Cells whose bprop doubles the gradient got 13-36 steps wrong in a single process; on
several processes the ranks then issue different backward collectives, so all-reduces pair
unrelated tensors (silently wrong sums) or fail ("AllReduce failed", "Memcpy error"). Every
communication region (`mm_parallel.mappings`) is such a Cell. With blocking launch
(``mindspore.runtime.launch_blocking()``) the same loops are exact, and on CPU they also run
4-5x faster (no dispatch threads competing for the cores).

The setting only takes effect before the process runs its first op (measured: switched on
after five steps, later steps still went wrong), so ``import mm_parallel`` switches it on, on
CPU; import mm_parallel before running any MindSpore op. On Ascend launch stays asynchronous
(blocking costs the device its overlap; the fault was not measured there): set
``MM_LAUNCH_BLOCKING=1`` to force blocking launch on any device, ``MM_LAUNCH_BLOCKING=0`` to keep
any device asynchronous.
"""

from __future__ import annotations

import os

import mindspore as ms


def wants_blocking_launch() -> bool:
    """Whether this process should launch ops synchronously (see the module docstring)."""
    forced = os.environ.get("MM_LAUNCH_BLOCKING")
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        raise ValueError(f"MM_LAUNCH_BLOCKING must be 0 or 1, got {forced!r}")
    return ms.get_context("device_target") == "CPU"


def configure():
    """Turn on blocking launch where `wants_blocking_launch` says so (called by ``import mm_parallel``)."""
    if wants_blocking_launch():
        ms.runtime.launch_blocking()
