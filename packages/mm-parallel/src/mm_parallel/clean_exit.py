"""A clean exit: the one object MindSpore 2.7.2 frees after its own teardown, emptied before it.

Measured: pyboost keeps the last operator a process ran, with its output tensors, in a static
object (``OpRunStatus::last_op_``). Static objects are destroyed after MindSpore has released its
memory pools at exit, so that operator's outputs are then freed into a released pool. A script
comparing our Wan with diffusers' (torch and MindSpore in one process, 3 heads, odd latent sizes,
forward only) passed its comparisons and then aborted in glibc ("corrupted size vs. prev_size in
fastbins", "corrupted double-linked list") in 1 to 3 runs of 4, with the native kernels on or off;
under AddressSanitizer every run ends in a SEGV in ``DynamicMemPoolBestFit::FreeTensorMem``,
reached from ``~OpRunStatus`` through ``~OpRunner`` and ``~Tensor`` in the exit handlers.

The release: a Python exit hook, registered when mm_parallel is imported, runs one operator
whose output owns no memory (the negation of an empty tensor). It becomes the last operator, so what
the static object frees at the end holds nothing of the pool. Python runs exit hooks last
registered first: this one runs before MindSpore's (registered when MindSpore was imported,
before mm_parallel) and after the hooks of a user script that imports mm_parallel first.
"""

from __future__ import annotations

import atexit

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

_STATE = {"installed": False}


def release_last_operator() -> None:
    """Make an operator that owns no memory the last one this process ran."""
    try:
        ops.neg(Tensor(np.zeros(0, np.float32)))  # neg: unlike add, it logs nothing for an empty tensor
        if ms.get_context("device_target") != "CPU":  # CPU has no stream to wait for (it logs an error)
            ms.runtime.synchronize()
    except Exception:  # noqa: BLE001 - an exit hook must not raise; a device already closed has no pool to harm
        pass


def install() -> None:
    """Register `release_last_operator` to run at exit (once per process)."""
    if not _STATE["installed"]:
        atexit.register(release_last_operator)
        _STATE["installed"] = True
