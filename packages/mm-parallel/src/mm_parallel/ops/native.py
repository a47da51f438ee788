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
crtfastmath, switching the loading process to flush-to-zero). Concurrent processes (msrun
workers) each write a temporary file and rename it into place.

Unavailable (``MM_NATIVE_KERNELS=0``, no compiler, a failed build): the kernels' callers take
their operator-by-operator path; the reason is logged once as a warning and kept in
`unavailable_reason`.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Dict, Optional

import mindspore as ms
from mindspore import ops

_SOURCES = Path(__file__).resolve().parent / "csrc"
_OBJECT_FLAGS = ["-O3", "-ffast-math", "-march=native", "-fPIC", "-std=c++17"]
_LINK_FLAGS = ["-shared", "-pthread"]
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
    """Why ``csrc/<name>.cc`` could not be used in this process, or None (built, or not asked yet)."""
    return _reasons.get(name)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler_version(compiler: str) -> str:
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout


def _build(source: Path, compiler: str, root: Path) -> Path:
    """The shared library of ``source``, compiled into the cache folder ``root`` unless already there."""
    headers = [header.read_text() for header in sorted(source.parent.glob("*.h"))]
    key = hashlib.sha256("\0".join([source.read_text(), *headers, " ".join(_OBJECT_FLAGS + _LINK_FLAGS),
                                    _compiler_version(compiler), platform.machine(), _cpu_flags()]).encode())
    library = root / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if library.exists():
        return library
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as work:
        obj, built = Path(work) / "kernel.o", Path(work) / "kernel.so"
        for command in ([compiler, *_OBJECT_FLAGS, "-c", str(source), "-o", str(obj)],
                        [compiler, *_LINK_FLAGS, str(obj), "-o", str(built)]):
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if done.returncode:
                raise RuntimeError(f"`{' '.join(command)}` failed: {done.stderr.strip()[-1500:]}")
        os.replace(built, library)  # atomic: another process may have put the same file there
    return library


@functools.lru_cache(maxsize=None)
def library(name: str) -> Optional[str]:
    """The compiled ``csrc/<name>.cc`` (its path), or None when it cannot be built (the reason
    logged once and kept in `unavailable_reason`)."""
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        _reasons[name] = (f"no C++ compiler `{compiler}` on PATH (install g++, e.g. apt-get install g++, or set CXX); "
                          "the CPU path runs operator by operator, slower")
    else:
        try:
            root = Path(os.environ.get("MM_CACHE_DIR") or Path.home() / ".cache" / "mm") / "kernels"
            return str(_build(_SOURCES / f"{name}.cc", compiler, root))
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            _reasons[name] = f"building csrc/{name}.cc failed: {error}"
    _log.warning("mm_parallel native CPU kernel %s unavailable: %s", name, _reasons[name])
    return None


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
    path = library(name)
    if path is None:
        return None
    out_shape, out_dtype = _OUTPUTS[outputs]
    return ops.Custom(f"{path}:{function}", out_shape=out_shape, out_dtype=out_dtype, func_type="aot")
