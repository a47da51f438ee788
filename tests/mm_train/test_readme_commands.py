"""Every command in the READMEs' fenced shell blocks runs as a user would type it.

The commands of each ```bash block in README.md and packages/*/README.md are read from the files,
in order, and run in one fresh folder (as a user following the READMEs does): `mm-train` runs
shortened by ``--set train.steps=2 --set data.samples=32``, placeholders (BASE, ADAPTERS, OUT,
SRC, runs/x/checkpoints/step_100) replaced by folders made for them. A command that cannot run
on this machine is listed in NOT_RUN with the reason and the test that covers it instead. A
command added to a README that is neither run nor listed, or a listed one that no README holds
any more, fails the test — so the commands cannot rot.
"""

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from helpers.mm_train_cli import mm_train_command

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
READMES = [ROOT / "README.md", *sorted(ROOT.glob("packages/*/README.md"))]
SHORT = ["--set", "train.steps=2", "--set", "data.samples=32"]
NOT_RUN = {
    "pip install hatch": "installs the tool this suite runs under (.ci/run does it on every CI machine)",
    "hatch test --all": "the suite itself",
    "hatch run mm-train doctor --nproc 2": "tests/mm_train/test_doctor.py runs it (with --json) and checks every row",
    "mm-train import llamafactory qwen2_5vl_lora_sft.yaml --nproc 8 -o recipe.yaml":
        "needs the user's LLaMA-Factory YAML and model folder; tests/mm_train/test_importing.py runs the command on "
        "one written in LLaMA-Factory's shape and trains what it writes",
    "mm-train import mindspeed examples/mindspore/qwen2.5vl/finetune_qwen2_5_vl_7b.sh -o qwen/recipe.yaml":
        "needs a MindSpeed-MM checkout; tests/mm_train/test_importing.py runs the command on a script and JSON "
        "written in their shapes and trains what it writes with the script's pipeline on two processes",
    "mm-train launch recipe.yaml --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 "
    "--nproc-per-node 8": "needs two machines of 8 devices; test_run runs `mm-train launch` as node 0 and node 1 on "
                          "loopback",
}


def readme_commands():
    """(README, command) for each line of every fenced bash block, comments and blank lines dropped."""
    found = []
    for readme in READMES:
        for block in re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```", readme.read_text(), re.S | re.M):
            for line in block.splitlines():
                command = line.split(" #")[0].strip()
                if command and not command.startswith("#"):
                    found.append((readme.relative_to(ROOT), command))
    return found


def test_every_readme_command_is_run_or_says_why_not():
    commands = {command for _, command in readme_commands()}
    assert len(commands) >= 10
    assert set(NOT_RUN) <= commands, f"NOT_RUN lists commands no README holds: {set(NOT_RUN) - commands}"
    runnable = [c for c in commands if c not in NOT_RUN]
    assert all(c.startswith(("mm-train ", "hatch run mm-train ")) or c == "mm-train" for c in runnable), runnable


def _placeholders(folder: Path, data: Path):
    """The folders the convert commands' placeholders stand for: a LoRA run's checkpoint (BASE, ADAPTERS,
    a step folder) and a MoE model folder (SRC)."""
    from helpers.qwen3_vl_reference import write_reference
    from helpers.train_runs import train

    lora = folder / "setup" / "lora"
    train(None, "qwen2_5_vl_tiny_lora", *SHORT, "--set", "checkpoint.every=2", "--set", f"output_dir={lora}",
          "--no-progress", data=data)
    step = lora / "checkpoints" / "step_2"
    write_reference(folder / "setup" / "moe", moe=True)
    return {"BASE": step / "model", "ADAPTERS": step / "adapters", "runs/x/checkpoints/step_100": step,
            "SRC": folder / "setup" / "moe"}


def _argv(command: str, places) -> list:
    words = shlex.split(command.removeprefix("hatch run "))  # hatch run: the same command in hatch's env
    # each convert writes a folder of its own
    places = {**places, "OUT": Path("converted") / words[2]} if words[1:2] == ["convert"] else places
    words = [str(places.get(w, w)) for w in words]
    if words[1:2] == ["run"]:
        words += SHORT + ["--no-progress"]
    return [mm_train_command()] + words[1:]


def test_readme_commands_run_as_written(tmp_path):
    data = tmp_path / "data"
    env = {**os.environ, "MM_TRAIN_DATA": str(data), "MM_TRAIN_VIDEO_DATA": str(tmp_path / "video")}
    places = _placeholders(tmp_path, data)
    user = tmp_path / "user"
    user.mkdir()
    done = set()
    for readme, command in readme_commands():
        if command in NOT_RUN or command.removeprefix("hatch run ") in done:
            continue
        done.add(command.removeprefix("hatch run "))
        result = subprocess.run(_argv(command, places), cwd=user, env=env, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, f"{readme}: `{command}` failed:\n{result.stderr[-3000:]}"
    assert (user / "runs" / "qwen2_5_vl_tiny" / "metrics.jsonl").exists()  # where README.md says a run writes
    assert (user / "runs" / "tp2" / "loss.png").exists()
