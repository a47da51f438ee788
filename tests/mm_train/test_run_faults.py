"""Faults of a multi-process run (the toy family, 2 workers): a rank that stops entering
collectives ends the run within train.collective_timeout, naming the waiting rank, the step, the
collective and the rank that never came; killing the launcher (kill -9) leaves no worker behind;
on Ascend HCCL's own collective timeout stays longer than the watchdog's."""

import os
import signal
import subprocess
import time

import pytest
from helpers.mm_train_cli import toy_cli, toy_command


@pytest.mark.distributed
def test_a_rank_that_stops_entering_collectives_is_named_within_the_timeout(tmp_path):
    start = time.time()
    result = toy_cli("run", "toy_tiny", "--nproc", "2", "--no-progress", "--set", "train.steps=50",
                     "--set", "train.collective_timeout=8", "--set", "data.stall_rank=1",
                     "--set", "data.stall_at_step=3", "--set", f"output_dir={tmp_path / 'out'}", timeout=300)
    elapsed = time.time() - start
    assert result.returncode != 0, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("mm-train: the run stopped: collective timeout: rank 0 waited"), result.stderr[-3000:]
    assert "over ranks [0,1] at step 3" in last and "rank 1 stopped entering collectives" in last, last
    assert "is at step 3 in no collective" in last, last
    assert elapsed < 150, elapsed  # msrun start (~20 s) + 2 steps + the 8 s timeout + the shutdown


@pytest.mark.distributed
def test_killing_the_launcher_stops_every_worker(tmp_path):
    out = tmp_path / "out"
    argv, env = toy_command("run", "toy_tiny", "--nproc", "2", "--no-progress", "--set", "train.steps=100000",
                            "--set", f"output_dir={out}")
    launcher = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids = out / "logs" / "node_0" / "pids"
    deadline = time.time() + 200
    while time.time() < deadline and not (out / "metrics.jsonl").exists():
        time.sleep(0.5)
    assert (out / "metrics.jsonl").exists(), "the run never started training"
    workers = [int((pids / f"rank_{r}.pid").read_text()) for r in (0, 1)] + [int((pids / "scheduler.pid").read_text())]
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.time() + 30
    while time.time() < deadline and any(_alive(pid) for pid in workers):
        time.sleep(0.5)
    assert not any(_alive(pid) for pid in workers), [pid for pid in workers if _alive(pid)]
    assert not _processes_reading(out / "logs"), "a process of the killed launch still reads its logs"


def _processes_reading(folder) -> list:
    """The command lines of live processes naming a file under ``folder`` (msrun's `tail -f`
    of the worker logs, started with --join and never stopped when msrun is killed)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(folder) in command and _alive(int(pid)):
            found.append(command)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited; only its parent has not read its status
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.parametrize("collective_timeout, exported, expected", [
    (600, None, None),  # the watchdog (600 s) already comes before CANN's default 1836 s
    (3000, None, "3060"),  # raised above the watchdog plus its margin, in whole multiples of 68
    (0, None, None),  # no watchdog: HCCL keeps its own default
    (3000, "7200", "7200"),  # the user's value is kept
    (3000, "900", "900"),  # ... even when shorter, with a warning
])
def test_hccl_waits_longer_than_the_watchdog(collective_timeout, exported, expected, capsys):
    from mm_train.cli import worker_environment
    from mm_train.recipe import load_recipe

    recipe = load_recipe(None, [f"train.collective_timeout={collective_timeout}"])
    environ = {} if exported is None else {"HCCL_EXEC_TIMEOUT": exported}
    env = worker_environment(recipe, "/tmp/pids", environ)
    assert env["MM_TRAIN_PID_DIR"] == "/tmp/pids"
    assert {**environ, **env}.get("HCCL_EXEC_TIMEOUT") == expected  # what the workers see
    warned = "below train.collective_timeout" in capsys.readouterr().err
    assert warned == (exported == "900")
    if exported is not None:  # a value that is no number is refused, saying what to export
        with pytest.raises(ValueError, match="HCCL_EXEC_TIMEOUT='soon' is not a number of seconds"):
            worker_environment(recipe, "/tmp/pids", {"HCCL_EXEC_TIMEOUT": "soon"})
