"""Run code under ``msrun`` with N CPU workers and collect what each rank returns.

    results = run_distributed(check_all_reduce, nproc=4, timeout=240, size=8)
    # results[r] is the JSON value rank r's check_all_reduce(size=8) returned

The function must live at module level in a file (a test module is fine): every worker loads
that file afresh and calls it. Return values travel as JSON (numpy arrays are encoded, nothing is
pickled). A launch gets a free port and a hard timeout: a hang kills the whole process group and
fails with the tail of every worker's log; a rank that raises fails the launch with its traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from mm_parallel.topology import RANKS_PER_NODE

_WORKER = Path(__file__).with_name("worker.py")
# Grace period for the other ranks once one rank has failed (they may be stuck in a collective).
_FAILURE_GRACE_S = 5.0


class DistributedRunError(RuntimeError):
    """A launch failed: a rank raised, a worker died, or the launch ran past its timeout."""


def die_with_parent() -> None:
    """Have Linux SIGKILL this process when its parent dies (prctl PR_SET_PDEATHSIG): msrun when
    its launcher is killed (kill -9, a batch system's SIGTERM), a worker when msrun is. A dead
    launcher then leaves no workers training on, writing checkpoints nobody asked for. Elsewhere
    a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def free_port() -> int:
    """A TCP port nobody listens on right now (the scheduler binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def encode(value: Any) -> Any:
    """JSON-ready form of a result: numpy arrays and scalars become tagged lists / numbers."""
    if isinstance(value, np.ndarray):
        return {"__ndarray__": value.tolist(), "dtype": str(value.dtype), "shape": list(value.shape)}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    return value


def decode(value: Any) -> Any:
    if isinstance(value, dict):
        if "__ndarray__" in value:
            return np.asarray(value["__ndarray__"], dtype=value["dtype"]).reshape(value["shape"])
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def _msrun() -> List[str]:
    beside = Path(sys.executable).with_name("msrun")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("msrun")
    if found:
        return [found]
    raise DistributedRunError("msrun was not found: install mindspore in this environment")


def _log_tail(path: Path, lines: int) -> str:
    if not path.exists():
        return f"(no log at {path})"
    text = path.read_text(errors="replace").splitlines()
    # MindSpore's cluster layer logs every TCP connection; keep the lines a person needs.
    kept = [t for t in text if not t.startswith(("[INFO]", "[WARNING] DISTRIBUTED"))]
    return "\n".join(kept[-lines:])


def launch(
    script: os.PathLike,
    nproc: int,
    args: Sequence[str] = (),
    timeout: float = 300.0,
    log_dir: Optional[os.PathLike] = None,
    env: Optional[Dict[str, str]] = None,
    failed: Callable[[], bool] = lambda: False,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: Optional[int] = None,
    cluster_timeout: Optional[int] = None,
    tick: Optional[Callable[[], None]] = None,
) -> Path:
    """Run ``script args`` under msrun with ``nproc`` local CPU workers; return the log folder.

    With ``nnodes`` > 1 this is node ``node_rank`` of a multi-node job of nnodes x nproc workers
    whose scheduler listens on master_addr:master_port (every node passes the same two).
    ``cluster_timeout``: seconds msrun waits for every worker to register (its default is 600).
    ``tick()`` is called every 0.2 s while msrun runs and once after (e.g. to relay a log).
    Raises DistributedRunError when the launch exits non-zero, when ``failed()`` turns true and
    the workers do not exit within a short grace, or after ``timeout`` seconds.
    """
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="mm_msrun_"))
    cmd, full_env, msrun_log = launch_command(script, nproc, args, log_dir, env, nnodes, node_rank, master_addr,
                                              master_port, cluster_timeout)
    with open(msrun_log, "wb") as sink:  # a file, not a pipe: a full pipe would block msrun
        proc = subprocess.Popen(cmd, env=full_env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent)
        try:
            reason = _wait(proc, timeout, failed, tick)
        except BaseException:  # Ctrl-C in the launcher: its own session does not get the signal
            _kill(proc)
            raise
    if tick is not None:
        tick()
    output = msrun_log.read_text(errors="replace")
    if reason is None and proc.returncode != 0:
        reason = f"msrun exited with {proc.returncode}"
    if reason:
        raise DistributedRunError(f"{Path(script).name} on {nproc} processes: {reason}\n"
                                  f"{worker_log_tails(log_dir, nproc)}\n--- msrun ---\n{output[-2000:]}")
    return log_dir


def launch_command(script: os.PathLike, nproc: int, args: Sequence[str], log_dir: Path,
                   env: Optional[Dict[str, str]] = None, nnodes: int = 1, node_rank: int = 0,
                   master_addr: str = "127.0.0.1", master_port: Optional[int] = None,
                   cluster_timeout: Optional[int] = None):
    """(msrun command, its environment, the file for msrun's own output) of a `launch`."""
    if nnodes > 1 and master_port is None:
        raise ValueError("a multi-node launch needs the master_port every node shares")
    cmd = _msrun() + [
        f"--worker_num={nproc * nnodes}",
        f"--local_worker_num={nproc}",
        f"--master_addr={master_addr}",
        f"--master_port={master_port or free_port()}",
        f"--node_rank={node_rank}",
        f"--log_dir={log_dir}",
        "--join=True",
        # with --join msrun copies each worker's log to its output through a `tail -f` child that
        # outlives a killed msrun (measured: two per killed 2-worker launch, adopted by init); no
        # worker in the list means no tail (the logs are read from their files instead)
        "--tail_worker_log=-2",
        *([f"--cluster_time_out={cluster_timeout}"] if cluster_timeout else []),
        str(script),
        *args,
    ]
    # msrun starts workers with the `python` found on PATH: make it this interpreter.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    log_dir.mkdir(parents=True, exist_ok=True)
    # the workers on each node: where hybrid ZeRO-3 (zero3_shard node) cuts its shard groups
    nodes = {RANKS_PER_NODE: str(nproc)}
    return cmd, {**os.environ, "PATH": path, "GLOG_v": "3", **nodes, **(env or {})}, log_dir / "msrun.out"


def worker_log_tails(log_dir: Path, nproc: int, lines: int = 40) -> str:
    return "\n".join(f"--- worker {r} (log tail) ---\n{_log_tail(log_dir / f'worker_{r}.log', lines)}"
                     for r in range(nproc))


def _wait(proc: subprocess.Popen, timeout: float, failed: Callable[[], bool],
          tick: Optional[Callable[[], None]] = None) -> Optional[str]:
    """Wait for msrun; kill its whole process group on timeout or when a rank failed and the
    others do not follow within the grace period. Returns why it was killed, or None."""
    start, failed_at = time.monotonic(), None
    while proc.poll() is None:
        if tick is not None:
            tick()
        now = time.monotonic()
        reason = None
        if now - start > timeout:
            reason = f"timed out after {timeout:.0f} s"
        elif failed_at is None and failed():
            failed_at = now
        elif failed_at is not None and now - failed_at > _FAILURE_GRACE_S:
            reason = "a rank failed and the others did not exit"
        if reason:
            _kill(proc)
            return reason
        time.sleep(0.2)
    return None


def _kill(proc: subprocess.Popen):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_distributed(
    fn: Callable,
    nproc: int,
    timeout: float = 300.0,
    env: Optional[Dict[str, str]] = None,
    **kwargs,
) -> List[Any]:
    """Call module-level ``fn(**kwargs)`` on ``nproc`` msrun workers; return each rank's result.

    kwargs must be JSON values. Results are listed by global rank. The workers see the caller's
    import path (after their own), so ``fn``'s module may import what the caller imports.
    """
    with tempfile.TemporaryDirectory(prefix="mm_dist_") as tmp:
        out = Path(tmp)
        (out / "spec.json").write_text(json.dumps(job_spec(fn, kwargs, out)))
        try:
            launch(_WORKER, nproc, [str(out / "spec.json")], timeout, out / "logs", env,
                   lambda: bool(list(out.glob("rank*.error"))))
        except DistributedRunError as e:
            tracebacks = rank_errors(out)
            raise DistributedRunError(f"{fn.__qualname__}: {tracebacks}\n{e}" if tracebacks else str(e)) from None
        return read_results(fn, out, nproc)


def job_spec(fn: Callable, kwargs: dict, out: Path) -> dict:
    """What a worker needs to call module-level ``fn(**kwargs)`` and where it writes the result."""
    source = Path(sys.modules[fn.__module__].__file__).resolve()
    return {"file": str(source), "function": fn.__qualname__, "kwargs": kwargs, "out": str(out),
            "path": [p for p in sys.path if p]}  # the workers import what the caller can


def rank_errors(out: Path) -> str:
    """The tracebacks of the ranks that raised, one after another."""
    return "\n".join(f"--- {p.stem} raised ---\n{p.read_text()}" for p in sorted(out.glob("rank*.error")))


def read_results(fn: Callable, out: Path, nproc: int) -> List[Any]:
    results = []
    for r in range(nproc):
        path = out / f"rank{r}.json"
        if not path.exists():
            raise DistributedRunError(f"{fn.__qualname__}: rank {r} exited without a result")
        results.append(decode(json.loads(path.read_text())))
    return results


__all__ = ["DistributedRunError", "decode", "encode", "free_port", "launch", "run_distributed"]
