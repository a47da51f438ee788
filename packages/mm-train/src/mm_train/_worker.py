"""What each msrun worker of ``mm-train run --nproc N`` (or ``launch``, ``generate``) runs.

A training worker loads the run record its launcher wrote (``--run-record PATH``, mm_train.cli):
the recipe as the launcher resolved and checked it. A generate worker runs the same command.

It first records its pid as ``$MM_TRAIN_PID_DIR/rank_<RANK_ID>.pid`` (``scheduler.pid`` in
msrun's scheduler process, which runs this script too, with MS_ROLE=MS_SCHED and RANK_ID=0) so
that the launcher can name a process msrun reports dead, and asks to die with msrun (which dies
with the launcher): killing ``mm-train`` stops the whole run.
"""

import os
import sys

import mm_parallel  # noqa: F401  (before any MindSpore op: blocking launch on CPU)
from mm_parallel.launch import die_with_parent
from mm_train.cli import main, run_recorded

if __name__ == "__main__":
    die_with_parent()
    pid_dir = os.environ.get("MM_TRAIN_PID_DIR")
    if pid_dir and "RANK_ID" in os.environ:
        os.makedirs(pid_dir, exist_ok=True)
        name = "scheduler" if os.environ.get("MS_ROLE") == "MS_SCHED" else f"rank_{os.environ['RANK_ID']}"
        with open(os.path.join(pid_dir, f"{name}.pid"), "w") as f:
            f.write(str(os.getpid()))
    if sys.argv[1] == "--run-record":  # mm-train run / launch: the run its launcher resolved
        sys.exit(run_recorded(sys.argv[2]))
    sys.exit(main(sys.argv[1:]))  # mm-train generate: the same command
