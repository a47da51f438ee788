"""What each msrun worker of ``mm-train run --nproc N`` runs: the same command, inside the launch.

It first records its pid as ``$MM_TRAIN_PID_DIR/rank_<RANK_ID>.pid`` so that the launcher can
name the rank of a worker msrun reports dead.
"""

import os
import sys

import mm_parallel  # noqa: F401  (before any MindSpore op: blocking launch on CPU)
from mm_train.cli import main

if __name__ == "__main__":
    pid_dir = os.environ.get("MM_TRAIN_PID_DIR")
    if pid_dir and "RANK_ID" in os.environ:
        os.makedirs(pid_dir, exist_ok=True)
        with open(os.path.join(pid_dir, f"rank_{os.environ['RANK_ID']}.pid"), "w") as f:
            f.write(str(os.getpid()))
    sys.exit(main(sys.argv[1:]))
