"""Soak (not in the default suite: ``hatch test -- -m soak tests/mm_train/test_soak.py``).

The tiny default on 2 processes, a checkpoint every 20 steps, and every MM_SOAK_KILL_EVERY
seconds (random, 0.5x to 1.5x; default 180) a kill -9 of a random worker or of the launcher,
then ``--resume``, until MM_SOAK_STEPS steps (default 3000: 14 minutes with 3 kills here on Dec 2;
MM_SOAK_STEPS=12000 for half an hour) are done. The loss of every step equals the uninterrupted
run's. The figures (kills, resumes, steps redone, time) are printed.
"""

import json
import os
import random
import signal
import subprocess
import time

import pytest
from helpers.mm_train_cli import mm_train, mm_train_command

pytestmark = [pytest.mark.soak, pytest.mark.distributed]

STEPS = int(os.environ.get("MM_SOAK_STEPS", 3000))
KILL_EVERY = float(os.environ.get("MM_SOAK_KILL_EVERY", 180))
ARGS = ["--nproc", "2", "--no-progress", "--set", "checkpoint.every=20", "--set", "checkpoint.keep=3",
        "--set", f"train.steps={STEPS}", "--set", f"optim.decay_steps={STEPS}"]


def rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def last_step(out) -> int:
    """The last step metrics.jsonl records (read while a run may be writing it)."""
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return max((json.loads(line)["step"] for line in lines[-3:-1]), default=0)
    except (OSError, ValueError):
        return 0


def test_kill_and_resume_for_half_an_hour_gives_the_uninterrupted_curve(tmp_path):
    data, out, rng = tmp_path / "data", tmp_path / "soak", random.Random(0)
    command = mm_train_command()
    env = {**os.environ, "MM_TRAIN_DATA": str(data)}
    started, kills, launches = time.time(), [], 0
    while True:
        launches += 1
        resume = ["--resume"] if launches > 1 else []
        proc = subprocess.Popen([command, "run", *ARGS, *resume, "--set", f"output_dir={out}"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            proc.wait(timeout=rng.uniform(0.5, 1.5) * KILL_EVERY)
        except subprocess.TimeoutExpired:
            victim = rng.choice(["rank_0", "rank_1", "launcher"])
            try:
                pid = proc.pid if victim == "launcher" else \
                    int((out / "logs" / "node_0" / "pids" / f"{victim}.pid").read_text())
                os.kill(pid, signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):  # that worker is not up (yet): kill the launcher
                victim = "launcher"
                os.kill(proc.pid, signal.SIGKILL)
            kills.append((victim, last_step(out)))
            proc.communicate(timeout=120)
            time.sleep(2)  # the workers of a killed launcher die with it (prctl), give them a moment
            continue
        assert proc.returncode == 0, proc.stderr.read()[-3000:]
        break
    soak_seconds = time.time() - started
    got = rows(out)
    start = time.time()
    whole = tmp_path / "whole"
    result = mm_train("run", *ARGS, "--set", f"output_dir={whole}", data=data, timeout=7200)
    assert result.returncode == 0, result.stderr[-3000:]
    reference = rows(whole)
    print(f"\nsoak: {STEPS} steps, {len(kills)} kills ({', '.join(f'{v} at step {s}' for v, s in kills)}), "
          f"{launches} launches, {soak_seconds:.0f} s with kills against {time.time() - start:.0f} s uninterrupted")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in reference], rel=1e-5)
