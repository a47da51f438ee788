"""What a multi-process run shows in the terminal: rank 0's own lines while it trains, and on a
failure one short account ending in the failing worker's own error line.

msrun writes each worker's output to ``LOG_DIR/worker_<rank>.log`` (MindSpore's warnings
included) and its own to ``msrun.out``. The launcher relays from rank 0's log only the lines
mm-train itself prints (progress, the final summary, ``mm-train:`` messages); the rest stays in
the logs. A failure's details (every worker's log tail, msrun's traceback) go to
``LOG_DIR/failure.txt``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import List, Optional

# what mm_train.loop / cli print while a run goes well; a failure's own line is shown by report_failure, last
OWN_LINES = ("step ", "loss ", "mm-train: resuming", "mm-train: --resume", "mm-train: --overwrite",
             "mm-train: skipping checkpoint", "mm-train: restored", "mm-train: removed")


class LogRelay:
    """Copies the complete lines of one log that start with ``OWN_LINES`` to ``stream``, as the log grows."""

    def __init__(self, log: Path, stream=None):
        self.log, self.stream, self.offset, self.partial = Path(log), stream or sys.stderr, 0, b""

    def __call__(self) -> None:
        try:
            with open(self.log, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace").rsplit("\r", 1)[-1].rstrip()
            if line.startswith(OWN_LINES):
                print(line, file=self.stream, flush=True)


def dead_workers(log_dir) -> str:
    """'worker rank R (pid P) died with exit code C; ' for each process msrun reports dead (its
    scheduler, which exits when a worker fails, named as such)."""
    out = Path(log_dir) / "msrun.out"
    if not out.exists():
        return ""
    names = {}
    for pid_file in (Path(log_dir) / "pids").glob("*.pid"):
        stem = pid_file.stem
        names[pid_file.read_text().strip()] = "msrun's scheduler" if stem == "scheduler" else \
            f"worker rank {stem.split('_', 1)[1]}"
    found = re.findall(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)",
                       out.read_text(errors="replace"))
    return "".join(f"{names.get(pid, 'a worker')} (pid {pid}) died with exit code {code}; every worker was "
                   "stopped. " for pid, code in found)


def last_error_line(log_dir, ranks: List[int]) -> Optional[str]:
    """The last ``mm-train:`` line of the first of ``ranks`` whose log has one (a worker's own
    account of why it stopped)."""
    for rank in ranks:
        log = Path(log_dir) / f"worker_{rank}.log"
        if log.exists():
            lines = [line.rsplit("\r", 1)[-1].strip() for line in log.read_text(errors="replace").splitlines()]
            errors = [line for line in lines if line.startswith("mm-train:")]
            if errors:
                return errors[-1]
    return None


def report_failure(log_dir, nproc: int, error: Exception, stream=None) -> None:
    """The failure in a few lines (the details into LOG_DIR/failure.txt), the failing worker's own
    error line last."""
    stream = stream or sys.stderr
    log_dir = Path(log_dir)
    (log_dir / "failure.txt").write_text(str(error))
    dead = dead_workers(log_dir)
    first = [int(r) for r in re.findall(r"worker rank (\d+)", dead)]
    print(f"mm-train: the run failed: {dead or str(error).splitlines()[0] + '. '}"
          f"Logs in {log_dir} (failure.txt: every worker's log tail and msrun's output)", file=stream)
    line = last_error_line(log_dir, first + [r for r in range(nproc) if r not in first])
    if line:
        print(line, file=stream)
