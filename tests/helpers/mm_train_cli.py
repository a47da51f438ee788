"""`mm-train` as a user runs it, in a subprocess: the command, its metrics rows, and the toy family.

The toy family (tests/helpers/toy_family) is importable only through $MM_TRAIN_FAMILIES with this
folder's parent on PYTHONPATH: nothing in mm-train names it.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def mm_train_command() -> str:
    """The `mm-train` of this interpreter's environment (hatch's test env), else the one on PATH."""
    return shutil.which("mm-train", path=os.path.dirname(sys.executable)) or "mm-train"


def mm_train(*args, data, timeout=600):
    env = {**os.environ, "MM_TRAIN_DATA": str(data)}
    return subprocess.run([mm_train_command(), *args], env=env, capture_output=True, text=True, timeout=timeout)


FIELDS = {"step", "loss", "grad_norm", "lr", "samples_per_s", "tokens_per_s", "mfu", "mem_bytes", "skipped"}
EVAL_FIELDS = {"val_loss", "samples"}  # the rows of the steps that validate / sample (mm_train.evaluation)
PACKING_FIELDS = {"padding_fraction", "tokens_max_over_mean", "batch_samples"}  # packed runs' rows
PREFERENCE_FIELDS = {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                     "logps/rejected", "logps/ref_chosen", "logps/ref_rejected", "errors/chosen", "errors/rejected",
                     "errors/ref_chosen", "errors/ref_rejected"}  # train.objective dpo's rows (clips: errors)
GRPO_FIELDS = {"reward", "reward_std", "kl", "clip_ratio", "completion_length", "generation_share"}  # and reward/<name>


def rows_of(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    known = FIELDS | EVAL_FIELDS | PACKING_FIELDS | PREFERENCE_FIELDS | GRPO_FIELDS | {"moe"}  # moe: MoE routing
    assert rows and all(FIELDS <= set(row) and all(k in known or k.startswith("reward/") for k in row) for row in rows)
    return rows


def parameters(out, folder=os.path.join("checkpoints", "step_3", "model")):
    """{name: array} of a run's saved model (the step 3 checkpoint unless ``folder`` says)."""
    from safetensors.numpy import load_file

    folder = os.path.join(out, folder)
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
    return tensors


def rel(a, b) -> float:
    import numpy as np

    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def parameter_errors(got, expected) -> dict:
    """rel-err of every parameter but the key projections' biases: a bias added to every key moves
    all of a query's scores alike, so its gradient is zero in exact arithmetic, and Adam turns the
    rounding noise left in it into steps of the learning rate's size."""
    assert set(got) == set(expected)
    return {key: rel(got[key], expected[key]) for key in expected if not key.endswith("k_proj.bias")}


def losses(out):
    return [row["loss"] for row in rows_of(out)]


def val_losses(out):
    """{step: validation loss} of a run."""
    return {row["step"]: row["val_loss"] for row in rows_of(out) if "val_loss" in row}


def sample_pixels(out, step, name="sample_0.png"):
    """A sample's contact sheet (uint8) as integers."""
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(os.path.join(out, "samples", f"step_{step}", name))).astype(int)


def toy_command(*args):
    """(argv, env) of `mm-train ARGS` with the toy family importable."""
    command = mm_train_command()
    env = {**os.environ, "MM_TRAIN_FAMILIES": "helpers.toy_family",
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return [command, *args], env


def toy_cli(*args, timeout=600):
    argv, env = toy_command(*args)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)


def launch_two_nodes(tmp_path, *args, outs, data, expect_ok=True, job_env=None, variables=None):
    """Two `mm-train launch` (node_rank 0 and 1, one worker each, one scheduler port) on this
    machine; ``outs``: each node's output_dir (two folders stand for two nodes' own disks).
    ``job_env(rank, port)``: the node's scheduler environment, given instead of the node flags.
    ``variables``: more environment for both. Returns each node's stderr."""
    from mm_parallel.launch import free_port

    port = str(free_port())
    env = {**os.environ, "MM_TRAIN_DATA": str(data), **(variables or {})}
    # Both "machines" are this one, so both msruns would find 127.0.0.1 among their addresses and
    # start a scheduler; node 1 gets an `ip` that lists no address (what a second machine would
    # report for node 0's address), so it starts only its worker, which joins node 0's scheduler.
    other_machine = tmp_path / "node1_bin"
    other_machine.mkdir(exist_ok=True)
    (other_machine / "ip").write_text("#!/bin/sh\necho '[]'\n")
    (other_machine / "ip").chmod(0o755)
    envs = [env, {**env, "PATH": f"{other_machine}{os.pathsep}{env['PATH']}"}]
    flags = [["--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", port]
             if job_env is None else [] for rank in (0, 1)]
    if job_env is not None:
        envs = [{**envs[rank], **job_env(rank, port)} for rank in (0, 1)]
    nodes = [subprocess.Popen([mm_train_command(), "launch", *args, "--set", f"output_dir={outs[rank]}", *flags[rank],
                               "--cluster-timeout", "120"],
                              env=envs[rank], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    errs = []
    for node in nodes:
        _, err = node.communicate(timeout=600)
        assert (node.returncode == 0) == expect_ok, err[-3000:]
        errs.append(err)
    return errs
