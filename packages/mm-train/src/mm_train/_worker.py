"""What each msrun worker of ``mm-train run --nproc N`` runs: the same command, inside the launch."""

import sys

import mm_parallel  # noqa: F401  (before any MindSpore op: blocking launch on CPU)
from mm_train.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
