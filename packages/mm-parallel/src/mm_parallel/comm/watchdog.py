"""Hangs that name their rank: a collective that waits longer than a timeout stops the process
with who waited, where, and which peer never came.

A rank that stops entering collectives (a stuck data loader, a dead file system, an infinite
loop) leaves its peers waiting inside their next collective for ever: msrun sees no dead process
and the job burns its booking. Every collective of `mm_parallel.comm` passes through `watched`,
which notes the call, its group and how many collectives this rank has made on that group. A
`Watchdog` thread (the backends release the GIL while they wait: measured, a Python thread ticks
29 times during a 3 s all-reduce wait) checks every second; when the current collective has
waited ``timeout`` seconds it calls ``on_hang`` with a report, by default printing it and
exiting the process (exit code `HANG_EXIT_CODE`), so the launcher stops the job.

With a ``heartbeat_dir`` on a file system every rank sees, each rank writes its state there every
second (``rank_<r>.json``: collectives per group, the current one, the step); the report then
names the peers of the group that have made fewer collectives on it than the waiting rank — the
ones that stopped coming — with their step and what they last did.

The measure is of the host call: on CPU (blocking launch) a collective returns when it is done.
Under asynchronous launch (Ascend) a call returns once queued and a hang surfaces at the next
host read; HCCL's own HCCL_EXEC_TIMEOUT covers that case.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Dict, Optional

HANG_EXIT_CODE = 75


class _Activity:
    """What this process's collectives are doing (one per process: collectives run on one thread)."""

    def __init__(self):
        self.current: Optional[str] = None
        self.group: Optional[str] = None
        self.since = 0.0
        self.counts: Dict[str, int] = {}
        self.last: Optional[str] = None
        self.step: Optional[int] = None


ACTIVITY = _Activity()


def watched(name: str, group_ranks, call: Callable, *args, **kwargs):
    """Run ``call(*args, **kwargs)``, a collective called ``name`` over ``group_ranks``, noted in
    `ACTIVITY` while it runs."""
    key = ",".join(map(str, group_ranks))
    a = ACTIVITY
    a.counts[key] = a.counts.get(key, 0) + 1
    a.current, a.group, a.since = name, key, time.monotonic()
    try:
        return call(*args, **kwargs)
    finally:
        a.last, a.current = f"{name} over ranks [{key}]", None


def set_step(step: int) -> None:
    """The training step this process is in (named in reports and heartbeats)."""
    ACTIVITY.step = step


class Watchdog:
    """See the module docstring. ``start()`` / ``stop()``; usable as a context manager."""

    def __init__(self, rank: int, timeout: float, heartbeat_dir: Optional[str] = None,
                 on_hang: Optional[Callable[[str], None]] = None, interval: float = 1.0):
        if timeout <= 0:
            raise ValueError(f"the collective timeout must be positive seconds, got {timeout}")
        self.rank, self.timeout, self.heartbeat_dir = rank, float(timeout), heartbeat_dir
        self.on_hang, self.interval = on_hang or _exit_with, min(interval, timeout / 4)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._paused = False

    def start(self) -> "Watchdog":
        if self.heartbeat_dir:
            os.makedirs(self.heartbeat_dir, exist_ok=True)
        self._thread = threading.Thread(target=self._watch, name="mm-collective-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @contextmanager
    def paused(self):
        """No timeout inside (heartbeats go on): waits that are long on purpose, e.g. the other
        ranks waiting while one writes and hashes a checkpoint."""
        self._paused = True
        try:
            yield self
        finally:
            self._paused = False

    __enter__ = start

    def __exit__(self, *exc):
        self.stop()

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            a = ACTIVITY
            if self.heartbeat_dir:
                self._beat(a)
            if not self._paused and a.current is not None and time.monotonic() - a.since > self.timeout:
                self.on_hang(self.report())
                return

    def _beat(self, a: _Activity) -> None:
        state = {"rank": self.rank, "time": time.time(), "step": a.step, "counts": dict(a.counts),
                 "current": a.current and f"{a.current} over ranks [{a.group}]", "last": a.last}
        path = os.path.join(self.heartbeat_dir, f"rank_{self.rank}.json")
        try:
            with open(path + ".tmp", "w") as f:
                json.dump(state, f)
            os.replace(path + ".tmp", path)
        except OSError:  # a heartbeat is a help for the report, never a reason to fail
            pass

    def report(self) -> str:
        """Who waits where, and the peers of that group that stopped entering collectives."""
        a = ACTIVITY
        mine = a.counts.get(a.group, 0)
        step = f" at step {a.step}" if a.step is not None else ""
        text = (f"rank {self.rank} waited {time.monotonic() - a.since:.0f} s (collective timeout {self.timeout:.0f} s)"
                f" in {a.current} over ranks [{a.group}]{step}, its collective #{mine} on that group")
        missing = self._missing_peers(a.group, mine)
        return text + ("; " + "; ".join(missing) if missing else "")

    def _missing_peers(self, group: str, mine: int):
        if not self.heartbeat_dir:
            return []
        lines = []
        for peer in (int(r) for r in group.split(",")):
            if peer == self.rank:
                continue
            try:
                with open(os.path.join(self.heartbeat_dir, f"rank_{peer}.json")) as f:
                    state = json.load(f)
            except (OSError, ValueError):
                lines.append(f"rank {peer} left no heartbeat")
                continue
            made = state["counts"].get(group, 0)
            if made < mine:
                doing = state["current"] or f"no collective (its last: {state['last']})"
                lines.append(f"rank {peer} stopped entering collectives: it made {made} on that group, is at step "
                             f"{state['step']} in {doing}, heartbeat {time.time() - state['time']:.0f} s ago")
        return lines


def _exit_with(report: str) -> None:
    print(f"collective timeout: {report}", file=sys.stderr, flush=True)
    os._exit(HANG_EXIT_CODE)
