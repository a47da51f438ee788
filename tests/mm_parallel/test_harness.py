"""The msrun harness itself, with a launch per call and with the session's worker pool: results
per rank, a raising rank and a hang both fail fast and say why; a pool keeps its processes from
job to job and is replaced after a failure."""

import os
import time
from pathlib import Path

import numpy as np
import pytest

from mm_parallel.launch import DistributedRunError, decode, encode

pytestmark = pytest.mark.distributed


def report_rank(scale):
    import mm_parallel

    topo = mm_parallel.initialize()
    return {"rank": topo.rank, "world": topo.world_size, "array": np.arange(3) * scale * topo.rank}


def rank_one_raises():
    import mm_parallel
    from mm_parallel import comm

    topo = mm_parallel.initialize()
    if topo.rank == 1:
        raise ValueError("rank one refuses")
    comm.barrier()  # rank 0 waits here for a partner that never comes


def rank_one_hangs():
    import mm_parallel

    topo = mm_parallel.initialize()
    if topo.rank == 1:
        time.sleep(600)
    return topo.rank


def pid():
    return os.getpid()


def large_result(n):
    import mm_parallel

    topo = mm_parallel.initialize()
    return {"rank": topo.rank, "names": [f"model.layers.{i}.mlp.weight" for i in range(n)]}


@pytest.fixture(params=["pool", "fresh"])
def launcher(request, run_distributed):
    """The session's pooled runner, or a launch of its own per call."""
    fresh = request.param == "fresh"
    return lambda fn, **kwargs: run_distributed(fn, fresh=fresh, **kwargs)


def test_results_come_back_by_rank(launcher):
    results = launcher(report_rank, nproc=2, timeout=120, scale=2)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 for r in results)
    np.testing.assert_array_equal(results[1]["array"], [0, 2, 4])


def test_a_large_result_is_read_whole(run_distributed):
    """A result of megabytes: the pool polls for result files, so a worker must publish them whole
    (a direct write was once read at its first 16 KiB; a launch of its own reads them after exit)."""
    for _ in range(3):
        results = run_distributed(large_result, nproc=2, timeout=120, n=200_000)
        assert [r["rank"] for r in results] == [0, 1]
        assert all(len(r["names"]) == 200_000 and r["names"][-1] == "model.layers.199999.mlp.weight" for r in results)


def test_a_raising_rank_fails_fast_with_its_traceback(launcher):
    start = time.monotonic()
    with pytest.raises(DistributedRunError, match="rank one refuses") as info:
        launcher(rank_one_raises, nproc=2, timeout=200)
    assert "rank1 raised" in str(info.value)
    assert time.monotonic() - start < 100, "a failed rank must not wait for the timeout"


def test_a_hang_is_killed_at_the_timeout(launcher):
    start = time.monotonic()
    with pytest.raises(DistributedRunError, match="timed out after 25 s") as info:
        launcher(rank_one_hangs, nproc=2, timeout=25)
    assert time.monotonic() - start < 60
    assert "worker 1 (log tail)" in str(info.value)


def test_a_pool_keeps_its_processes_and_is_replaced_after_a_failure(run_distributed):
    first = run_distributed(pid, nproc=2, timeout=120)
    assert run_distributed(pid, nproc=2, timeout=120) == first  # the same two processes
    with pytest.raises(DistributedRunError, match="rank one refuses"):
        run_distributed(rank_one_raises, nproc=2, timeout=200)
    again = run_distributed(pid, nproc=2, timeout=120)
    assert len(set(again)) == 2 and not set(again) & set(first)  # a new pool


def test_encoding_round_trip_without_pickle():
    value = {"a": np.arange(6, dtype=np.int16).reshape(2, 3), "b": [np.float32(1.5), "x"], "c": None}
    back = decode(encode(value))
    assert back["a"].dtype == np.int16 and back["a"].shape == (2, 3)
    assert back["b"] == [1.5, "x"] and back["c"] is None


OWNER = """
import json, sys, time
sys.path.insert(0, {tests!r})
from mm_parallel.launch.pool import WorkerPool
from test_harness import pid
pool = WorkerPool(2)
print(json.dumps(pool.run(pid, timeout=120)), flush=True)
time.sleep(600)
"""


def test_pool_workers_exit_when_their_owner_is_killed(tmp_path):
    """kill -9 of the process owning a pool (a test session killed by hand skips its atexit
    close): the workers notice and exit instead of serving a pool nobody feeds."""
    import json
    import signal
    import subprocess
    import sys

    script = tmp_path / "owner.py"
    script.write_text(OWNER.format(tests=str(Path(__file__).parent)))
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        workers = json.loads(owner.stdout.readline())
        assert len(workers) == 2 and all(_alive(p) for p in workers)
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    deadline = time.time() + 30
    while time.time() < deadline and any(_alive(p) for p in workers):
        time.sleep(0.2)
    assert not any(_alive(p) for p in workers), f"pool workers {workers} outlived their owner"


def _alive(process_id: int) -> bool:
    try:
        os.kill(process_id, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by msrun) counts as gone
        return Path(f"/proc/{process_id}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False
