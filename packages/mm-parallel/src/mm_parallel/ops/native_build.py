"""The native kernels' shared libraries: built once per host, kept in a cache that cannot hand a
process a broken or foreign file.

    build(source)  under a lock on the cache folder (one process of a host compiles, the others
                   wait and take its result): a library whose record matches is used as it is;
                   none, or one that fails `verify`, is compiled again
    verify(lib)    the library is the file its build wrote: same size and sha256 as the record
                   beside it (``<lib>.json``, written after the library), and only this user can
                   write either
    private(dir)   the cache folder belongs to this user and no one else can write it: a library
                   anyone could replace would run inside every training process

Measured reasons: a library cut short (a full disk, a copy interrupted) was trusted because it
existed, and failed at its first call, outside any fallback; on a cold cache every msrun worker
compiled the same sources at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

OBJECT_FLAGS = ["-O3", "-ffast-math", "-march=native", "-fPIC", "-std=c++17"]
LINK_FLAGS = ["-shared", "-pthread"]
_log = logging.getLogger(__name__)


class UnsafeCache(RuntimeError):
    """The cache folder or a file in it is not this user's alone."""


def private(path: Path) -> None:
    """Raise UnsafeCache unless ``path`` belongs to this user and no one else may write it."""
    info = os.stat(path)
    if info.st_uid != os.getuid():
        raise UnsafeCache(f"{path} belongs to user id {info.st_uid}, not to this user ({os.getuid()}): "
                          "set MM_CACHE_DIR to a folder of your own")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCache(f"{path} is writable by other users (mode {oct(stat.S_IMODE(info.st_mode))}), who could "
                          f"replace a kernel library loaded by every training process: `chmod go-w {path}`, or "
                          "set MM_CACHE_DIR to a folder only you can write")


def _record(library: Path) -> Path:
    return library.with_name(library.name + ".json")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()  # a kernel library is tens of kB


def verify(library: Path) -> Optional[str]:
    """None when ``library`` is the file its build recorded; else what is wrong with it."""
    try:
        record = json.loads(_record(library).read_text())
        private(library)
        private(_record(library))
    except (OSError, ValueError, UnsafeCache) as error:
        return f"no readable build record for {library.name} ({error})"
    size = library.stat().st_size
    if size != record.get("size"):
        return f"{library.name} is {size} bytes, its build wrote {record.get('size')} (cut short?)"
    if _sha256(library) != record.get("sha256"):
        return f"{library.name} is not the file its build wrote (sha256 differs)"
    return None


@contextlib.contextmanager
def _host_lock(path: Path):
    """One holder at a time among this host's processes (fcntl.flock: released if the holder dies)."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def library_path(source: Path, compiler: str, root: Path) -> Path:
    """Where ``source``'s library lives: named by the source and its headers, the flags, the
    compiler's version and the CPU."""
    headers = [header.read_text() for header in sorted(source.parent.glob("*.h"))]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([source.read_text(), *headers, " ".join(OBJECT_FLAGS + LINK_FLAGS), version,
                                    platform.machine(), _cpu_flags()]).encode())
    return root / f"{source.stem}-{key.hexdigest()[:16]}.so"


def _compile(source: Path, compiler: str, root: Path, library: Path) -> None:
    with tempfile.TemporaryDirectory(dir=root) as work:
        obj, built = Path(work) / "kernel.o", Path(work) / "kernel.so"
        for command in ([compiler, *OBJECT_FLAGS, "-c", str(source), "-o", str(obj)],
                        [compiler, *LINK_FLAGS, str(obj), "-o", str(built)]):
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if done.returncode:
                raise RuntimeError(f"`{' '.join(command)}` failed: {done.stderr.strip()[-1500:]}")
        os.chmod(built, 0o755)
        record = Path(work) / "record.json"
        record.write_text(json.dumps({"size": built.stat().st_size, "sha256": _sha256(built),
                                      "source": source.name}))
        _record(library).unlink(missing_ok=True)  # no moment where an old record vouches for a new file
        os.replace(built, library)
        os.replace(record, _record(library))


def build(source: Path, compiler: str, root: Path) -> Path:
    """The verified shared library of ``source`` in the cache folder ``root`` (module docstring)."""
    root.mkdir(parents=True, exist_ok=True, mode=0o755)
    private(root)
    library = library_path(source, compiler, root)
    with _host_lock(root / f".{source.stem}.lock"):
        problem = verify(library) if library.exists() else None
        if library.exists() and problem is None:
            return library
        if problem:
            _log.warning("mm_parallel native kernel %s: %s; building it again", source.stem, problem)
        _compile(source, compiler, root, library)
    return library
