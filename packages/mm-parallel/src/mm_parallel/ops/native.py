"""Fused CPU kernels compiled from C++ at first use (MindSpore custom operators, ``func_type="aot"``).

MindSpore's CPU path runs an elementwise chain as one kernel per operator, each a pass over
memory: gelu-tanh's forward is 7 passes (7-10 ms on 2048 x 2048 here), its written-out backward
about 12 (~30 ms). A C++ loop does each direction in one pass (1.4 ms forward on the same tensor:
`benchmarks/native_kernels.py` prints both). The sources sit next to this module
(``csrc/<name>.cc``, helpers in ``csrc/common.h``); each exports MindSpore's aot entry points
``int f(nparam, params, ndims, shapes, dtypes, stream, extra)``.

Build: ``$CXX`` (default ``g++``) compiles a source once per (source and headers, flags, compiler, CPU) into
``$MM_CACHE_DIR/kernels`` (default ``~/.cache/mm/kernels``): the object with ``-O3 -ffast-math
-march=native``, the shared library linked without ``-ffast-math`` (GCC 12 would link
crtfastmath, switching the loading process to flush-to-zero). `mm_parallel.ops.native_build`
keeps that cache trustworthy: one build per host under a lock, each library checked against the
size and sha256 its build recorded before it is loaded, a folder others can write refused.

Unavailable (``MM_NATIVE_KERNELS=0``, no compiler, a failed build or load, an unsafe cache):
the kernels' callers take their operator-by-operator path; the reason is logged once as a warning
and kept in `unavailable_reason`. On several processes every rank must take the same path (the
two give results equal to rounding, not bit for bit, and a kernel's Cell is part of the backward
graph): `agree_across_ranks`, called by `mm_parallel.initialize`, keeps a kernel only where every
rank has it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Dict, List, Optional

import mindspore as ms
from mindspore import ops

from mm_parallel.ops import native_build

_SOURCES = Path(__file__).resolve().parent / "csrc"
_reasons: Dict[str, str] = {}
_log = logging.getLogger(__name__)
_SETTING = {"enabled": os.environ.get("MM_NATIVE_KERNELS", "1") != "0"}  # read once, when mm_parallel loads


def enabled() -> bool:
    """Whether native kernels may be used: on a CPU device (they read and write host memory; the
    reference path on Ascend, ``MM_KERNELS=reference``, keeps MindSpore's operators), unless
    ``MM_NATIVE_KERNELS=0`` at start-up or `set_enabled` turned them off."""
    return _SETTING["enabled"] and ms.get_context("device_target") == "CPU"


def set_enabled(on: bool) -> None:
    """Use native kernels (True) or the operator-by-operator path (False) from now on."""
    _SETTING["enabled"] = bool(on)


_CELLS: Dict[str, object] = {}


def cell(key: str, build: Callable[[], object]):
    """The Cell ``build()`` makes for ``key`` (None: its kernels do not build), made once; None
    while native kernels are turned off."""
    if not enabled():
        return None
    if key not in _CELLS:
        _CELLS[key] = build()
    return _CELLS[key]


def unavailable_reason(name: str) -> Optional[str]:
    """Why ``csrc/<name>.cc`` is not used in this process, or None (built, or not asked yet)."""
    return _VETOED.get(name) or _reasons.get(name)


@functools.lru_cache(maxsize=None)
def library(name: str) -> Optional[str]:
    """The compiled ``csrc/<name>.cc`` (its path), built, verified and loaded once in this
    process, or None when it cannot be (the reason logged once and kept in `unavailable_reason`)."""
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        _reasons[name] = (f"no C++ compiler `{compiler}` on PATH (install g++, e.g. apt-get install g++, or set CXX); "
                          "the CPU path runs operator by operator, slower")
    else:
        try:
            root = Path(os.environ.get("MM_CACHE_DIR") or Path.home() / ".cache" / "mm") / "kernels"
            path = native_build.build(_SOURCES / f"{name}.cc", compiler, root)
            ctypes.CDLL(str(path))  # a library that does not load is found here, not at its first call
            return str(path)
        except native_build.UnsafeCache as error:
            _reasons[name] = f"the kernel cache is not safe to load from: {error}"
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            _reasons[name] = f"building or loading csrc/{name}.cc failed: {error}"
    _log.warning("mm_parallel native CPU kernel %s unavailable: %s", name, _reasons[name])
    return None


KERNELS = tuple(sorted(path.stem for path in _SOURCES.glob("*.cc")))
_VETOED: Dict[str, str] = {}  # kernels another rank cannot use: not used here either
_AGREED = {"done": False}


def agree_across_ranks(all_min: Callable[[List[int]], List[int]]) -> None:
    """Keep each kernel only if every rank can use it. ``all_min`` takes this rank's flags (1 =
    usable) and returns the minimum over the ranks (one collective). Once per process, from
    `mm_parallel.initialize` (every rank calls it, so the collective pairs)."""
    if _AGREED["done"]:
        return
    mine = [int(enabled() and library(name) is not None) for name in KERNELS]
    for name, here, everywhere in zip(KERNELS, mine, all_min(mine)):
        if here and not everywhere:
            _VETOED[name] = ("another rank of this run cannot use it (its log says why); every rank takes the "
                             "operator-by-operator path, as results must not depend on the rank")
            _log.warning("mm_parallel native CPU kernel %s unused: %s", name, _VETOED[name])
    if _VETOED:
        _CELLS.clear()
        _operator.cache_clear()
    _AGREED["done"] = True


def forget() -> None:
    """Forget the built libraries, the agreement and the reasons (a test that changes the cache
    folder or the compiler; the next `mm_parallel.initialize` agrees again)."""
    library.cache_clear()
    _operator.cache_clear()
    _CELLS.clear()
    _reasons.clear()
    _VETOED.clear()
    _AGREED["done"] = False


def _same_shape(*shapes):
    return shapes[0]


def _same_dtype(*dtypes):
    return dtypes[0]


def _rows_and_row_scale(shape, _eps_shape):
    return shape, list(shape[:-1]) + [1]


def _both_of(dtype, _eps_dtype):
    return dtype, dtype


def _two_like_first(*shapes_or_dtypes):
    return shapes_or_dtypes[0], shapes_or_dtypes[0]


def _dims_1_2_swapped(shape):
    return [shape[0], shape[2], shape[1], shape[3]]


# what an operator outputs: its shapes and dtypes from its inputs'
_OUTPUTS = {
    "like_first": (_same_shape, _same_dtype),            # one tensor like the first input
    "rows_and_row_scale": (_rows_and_row_scale, _both_of),  # (x, eps) -> (like x, one value per row)
    "two_like_first": (_two_like_first, _two_like_first),    # two tensors like the first input
    "dims_1_2_swapped": (_dims_1_2_swapped, _same_dtype),    # (a, b, c, d) -> (a, c, b, d)
}


def operator(name: str, function: str, outputs: str = "like_first") -> Optional[ops.Custom]:
    """``function`` of ``csrc/<name>.cc`` as an operator (``outputs``: see _OUTPUTS), or None
    when native kernels are turned off or unavailable."""
    if not enabled():
        _reasons[name] = ("turned off (MM_NATIVE_KERNELS=0 at start-up, or native.set_enabled(False)), "
                          "or the device is not a CPU")
        return None
    return _operator(name, function, outputs)


@functools.lru_cache(maxsize=None)
def _operator(name: str, function: str, outputs: str) -> Optional[ops.Custom]:
    path = None if name in _VETOED else library(name)
    if path is None:
        return None
    if not hasattr(ctypes.CDLL(path), function):
        _reasons[name] = f"csrc/{name}.cc's library has no function {function}"
        _log.warning("mm_parallel native CPU kernel %s unavailable: %s", name, _reasons[name])
        return None
    out_shape, out_dtype = _OUTPUTS[outputs]
    return ops.Custom(f"{path}:{function}", out_shape=out_shape, out_dtype=out_dtype, func_type="aot")
