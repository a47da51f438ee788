"""How the HCCL stand-ins move data: files in a directory the processes of one launch share.

The stand-ins of `mm_parallel.testing.hccl` must not move data by the code they check (mm's
CPU backend, itself built on mccl), so they move it by the simplest means that cannot share a
fault with it: each message is one file, written whole under a temporary name and renamed (a
reader never sees half of it), read with numpy.

    collective on a group:  every member writes   <dir>/g<ranks>.<n>.r<rank>   and reads all of them
    point to point:         the sender writes     <dir>/p<src>to<dst>.<n>      and the receiver reads it

``n`` counts the calls on that group (or channel) in this process; like HCCL, the stand-ins need
every member to call a group's collectives in one order, and each message carries what was
called (name, dtype, shape, arguments), so a member that called something else is named instead
of being paired with the wrong tensor. A member deletes its message of call n - 1 once every
message of call n is there: by then each member has finished call n - 1. A file holds a JSON
header (4-byte length first) and the array's bytes; nothing is pickled.

The directory: ``$MM_HCCL_STAND_IN_DIR``, else one per launch in the temporary directory, named
by msrun's process (the workers' parent) and its scheduler port. One host only: the stand-ins
run the Ascend path on a CPU machine.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np

Message = Tuple[dict, np.ndarray]  # (what was called: name, dtype, shape and arguments; the data)
WAIT_S = 300.0  # a member this late has failed (a worker pool's job times out at 300 s too)


def _directory() -> Path:
    named = os.environ.get("MM_HCCL_STAND_IN_DIR")
    if named:
        return Path(named)
    launch = f"{os.getppid()}-{os.environ.get('MS_SCHED_PORT', 'single')}"
    return Path(tempfile.gettempdir()) / f"mm-hccl-stand-in-{launch}"


def _write(path: Path, message: Message) -> None:
    header, data = message
    head = json.dumps(header).encode()
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(head).to_bytes(4, "little"))
        f.write(head)
        f.write(np.ascontiguousarray(data).tobytes())
    os.replace(tmp, path)


def _read(path: Path) -> Message:
    raw = path.read_bytes()
    size = int.from_bytes(raw[:4], "little")
    header = json.loads(raw[4 : 4 + size])
    data = np.frombuffer(raw[4 + size :], dtype=header["storage"]).reshape(header["shape"])
    return header, data


def _wait_for(paths: Sequence[Path], what: str, timeout: float) -> None:
    start, pause = time.monotonic(), 0.0002
    while True:
        missing = [p for p in paths if not p.exists()]
        if not missing:
            return
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"HCCL stand-in: {what} waited {timeout:.0f} s for "
                               f"{', '.join(p.name for p in missing)}: a member did not make the call")
        time.sleep(pause)
        pause = min(pause * 2, 0.002)


class Mailbox:
    """This process's end of the message files (module docstring)."""

    def __init__(self, rank: int, directory: Path = None, timeout: float = WAIT_S):
        self.rank, self.timeout = rank, timeout
        self.dir = Path(directory) if directory is not None else _directory()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.calls: Dict[str, int] = {}

    def _next(self, key: str) -> int:
        self.calls[key] = self.calls.get(key, -1) + 1
        return self.calls[key]

    def gather(self, ranks: Sequence[int], message: Message) -> List[Message]:
        """Every member's message, in the order of ``ranks`` (this rank among them)."""
        key = "g" + "-".join(str(r) for r in ranks)
        n = self._next(key)
        _write(self.dir / f"{key}.{n}.r{self.rank}", message)
        paths = [self.dir / f"{key}.{n}.r{r}" for r in ranks]
        _wait_for(paths, f"{message[0]['name']} on ranks {list(ranks)}", self.timeout)
        if n:
            (self.dir / f"{key}.{n - 1}.r{self.rank}").unlink(missing_ok=True)
        return [_read(p) for p in paths]

    def send(self, dst: int, message: Message) -> None:
        key = f"p{self.rank}to{dst}"
        _write(self.dir / f"{key}.{self._next(key)}", message)

    def receive(self, src: int) -> Message:
        key = f"p{src}to{self.rank}"
        path = self.dir / f"{key}.{self._next(key)}"
        _wait_for([path], f"a receive from rank {src}", self.timeout)
        message = _read(path)
        path.unlink()
        return message
