"""One msrun worker of `run_distributed`: load the target file, call the function, write the result.

Usage (by the harness): ``worker.py SPEC.json`` with SPEC = {file, function, kwargs, out}.
Writes ``out/rank{R}.json`` on success and ``out/rank{R}.error`` (the traceback) on failure.
``worker.py --pool DIR`` is a `WorkerPool` worker: it runs DIR/job0.json, job1.json, ... in
turn as they appear (each a SPEC), and exits when DIR/stop appears or the process that owns the
pool (its pid in DIR/owner) is gone: a killed test session leaves no worker behind.
"""

import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path


def _rank() -> int:
    # msrun numbers its workers (RANK_ID) in the environment before MindSpore is imported.
    return int(os.environ.get("RANK_ID", "0"))


def main(spec_path: str) -> int:
    return run_job(json.loads(Path(spec_path).read_text()))


def _serving(pool: Path, owner: int) -> bool:
    """No stop file yet, and the pool's owner still alive."""
    if (pool / "stop").exists():
        return False
    try:
        os.kill(owner, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def serve(pool: Path) -> int:
    """Run the pool's jobs in order until its stop file appears (polled every 20 ms).

    msrun runs the script in its scheduler process too (MS_ROLE=MS_SCHED): there it only serves
    the cluster. Every worker joins the world first, so the cluster is complete whatever the jobs
    do (a job that never initialises would otherwise leave the scheduler waiting for it, and
    the scheduler must never answer a job as a rank)."""
    from mindspore.communication import init

    import mm_parallel

    owner = int((pool / "owner").read_text())
    if os.environ.get("MS_ROLE") == "MS_SCHED":
        init()
        while _serving(pool, owner):
            time.sleep(0.2)
        return 0
    mm_parallel.comm.get_backend().init_world()
    job = 0
    while _serving(pool, owner):
        spec = pool / f"job{job}.json"
        if spec.exists():
            run_job(json.loads(spec.read_text()))
            job += 1
        else:
            time.sleep(0.02)
    return 0


def run_job(spec: dict) -> int:
    out = Path(spec["out"])
    rank = _rank()
    try:
        from mm_parallel.launch import encode

        # The target's folder goes on the path, so it imports its sibling helper modules; the
        # caller's path follows the worker's own (test helper folders, e.g. pytest's pythonpath).
        sys.path.insert(0, str(Path(spec["file"]).parent))
        sys.path.extend(p for p in spec.get("path", []) if p not in sys.path)
        module_spec = importlib.util.spec_from_file_location("_mm_distributed_target", spec["file"])
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module
        module_spec.loader.exec_module(module)
        fn = module
        for part in spec["function"].split("."):
            fn = getattr(fn, part)
        result = fn(**spec["kwargs"])
        publish(out / f"rank{rank}.json", json.dumps(encode(result)))
        return 0
    except BaseException:
        publish(out / f"rank{rank}.error", traceback.format_exc())
        return 1


def publish(path: Path, text: str) -> None:
    """Write ``path`` so that it appears whole: the pool and its workers poll for each other's files
    and read them at once (a direct write was once read at its first 16 KiB and failed a CI run
    with a JSON error). Standard library only: the worker imports it before MindSpore."""
    staged = path.with_name(f".{path.name}.tmp")
    staged.write_text(text)
    staged.rename(path)


if __name__ == "__main__":
    sys.exit(serve(Path(sys.argv[2])) if sys.argv[1] == "--pool" else main(sys.argv[1]))
