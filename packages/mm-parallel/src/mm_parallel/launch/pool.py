"""`WorkerPool`: msrun workers started once and given one job after another.

A launch costs 14-20 s here before any test code runs (msrun, MindSpore's import, the
collectives' start-up; measured with a job that only initialises: 14 s on 2 processes, 20 s on
4), about as much as the job itself for most multi-process tests. A pool pays it once per
process count and session. Every job is `run_distributed`'s (the target file loaded afresh, the
function called on every rank, results as JSON); jobs run in order, each on all ranks. A job
whose rank raises, that times out or whose workers die ends the pool (the other ranks may be
left inside a collective): the error is raised as `run_distributed` raises it and the next job
starts a new pool. Jobs must not depend on being the first thing their processes run — those
(the harness's own tests, start-up checks) call `run_distributed` directly.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, List, Optional

from mm_parallel import launch
from mm_parallel.launch.worker import publish


class WorkerPool:
    """``nproc`` msrun workers kept alive between `run` calls (module docstring)."""

    def __init__(self, nproc: int):
        self.nproc, self.jobs, self.proc = nproc, 0, None
        self.dir: Optional[Path] = None

    def _start(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="mm_pool_"))
        publish(self.dir / "owner", str(os.getpid()))  # workers exit when this process is gone
        self.jobs = 0
        cmd, env, log = launch.launch_command(launch._WORKER, self.nproc, ["--pool", str(self.dir)],
                                               self.dir / "logs")
        self.sink = open(log, "wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.sink, stderr=subprocess.STDOUT, start_new_session=True)
        atexit.register(self.close)  # workers in their own session outlive a caller that forgets them

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def run(self, fn: Callable, timeout: float = 300.0, **kwargs) -> List[Any]:
        """`run_distributed(fn, nproc, timeout, **kwargs)` on the pool's workers."""
        if not self.alive():
            self._start()
        out = self.dir / f"out{self.jobs}"
        out.mkdir()
        spec = launch.job_spec(fn, kwargs, out)
        publish(self.dir / f"job{self.jobs}.json", json.dumps(spec))  # appears whole to the polling workers
        self.jobs += 1
        reason = self._wait(out, timeout)
        if reason:
            tracebacks = launch.rank_errors(out)
            tails = launch.worker_log_tails(self.dir / "logs", self.nproc)
            self.close(stuck=True)
            raise launch.DistributedRunError(f"{fn.__qualname__} on a pool of {self.nproc}: {reason}\n"
                                              f"{tracebacks}\n{tails}")
        return launch.read_results(fn, out, self.nproc)

    def _wait(self, out: Path, timeout: float) -> Optional[str]:
        start, failed_at = time.monotonic(), None
        while True:
            done = len(list(out.glob("rank*.json"))) + len(list(out.glob("rank*.error")))
            errors = list(out.glob("rank*.error"))
            if done == self.nproc:
                return "a rank raised" if errors else None
            now = time.monotonic()
            if not self.alive():
                return f"the workers exited ({self.proc.returncode})"
            if now - start > timeout:
                return f"timed out after {timeout:.0f} s"
            if errors and failed_at is None:
                failed_at = now
            if failed_at is not None and now - failed_at > launch._FAILURE_GRACE_S:
                return "a rank raised and the others did not finish"
            time.sleep(0.05)

    def close(self, stuck: bool = False) -> None:
        """Stop the workers: a stop file, then killed if they do not exit within 30 s; killed at
        once when ``stuck`` (after a failed job the other ranks wait inside a collective, and the
        30 s were spent on every failure)."""
        if self.proc is None:
            return
        (self.dir / "stop").write_text("")
        if stuck:
            launch._kill(self.proc)
        else:
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                launch._kill(self.proc)
        self.sink.close()
        self.proc = None
