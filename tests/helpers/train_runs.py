"""`mm-train run` inside the test session's own processes, for the tests that sweep layouts.

`mm-train run --nproc N` starts msrun, whose N workers each call `mm_train.cli.main` with the
same arguments. test_run.py, test_run_faults.py and test_resume.py prove that launch itself (rank
0's lines relayed, the failure lines, a killed worker, two nodes on loopback). A layout sweep needs
only what the workers do, so it calls that same `main`: in the pytest process for one process and
on the session's msrun worker pool (conftest's `run_distributed`) for N. A launch costs about 20 s
before the first step here (msrun, MindSpore's import, the collectives' start-up), as much as a
tiny run itself; the sweeps made some forty of them.
"""

import contextlib
import io
import os
import sys


@contextlib.contextmanager
def _variables(values):
    """``values`` set in os.environ for the block, the previous values restored after it."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def main_on_this_rank(argv, variables):
    """`mm_train.cli.main(argv)` with the environment ``variables`` set; what every rank of a
    launched run executes; returns what mm-train printed (a non-zero exit raises with it)."""
    from mm_train.cli import main

    printed = io.StringIO()
    with _variables(variables), contextlib.redirect_stderr(printed):
        code = main(list(argv))
    if code != 0:
        raise RuntimeError(f"mm-train {' '.join(argv)} exited with {code}:\n{printed.getvalue()[-3000:]}")
    sys.stderr.write(printed.getvalue())
    return printed.getvalue()


def train(run_distributed, *args, nproc=1, data, variables=None):
    """`mm-train run ARGS [--nproc N]` with MM_TRAIN_DATA=data (and ``variables``), as its workers
    run it (module docstring): in this process for one process, on the pool of ``nproc`` workers
    otherwise. Returns what rank 0 printed to stderr."""
    argv = ["run", *args] + (["--nproc", str(nproc)] if nproc > 1 else [])
    variables = {"MM_TRAIN_DATA": str(data), **(variables or {})}
    if nproc == 1:
        return main_on_this_rank(argv, variables)
    return run_distributed(main_on_this_rank, nproc=nproc, timeout=900, argv=argv, variables=variables)[0]
