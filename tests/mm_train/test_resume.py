"""Checkpoints and --resume: a resumed run continues bit for bit on the same layout; a checkpoint
written under TP2, DP2 ZeRO-1 or DP2 ZeRO-3 (its weights held as flat slices) resumes on one
process (and one from one process under TP2) with the losses of the uninterrupted run; incomplete
checkpoint folders are never picked."""

import json
import os

import numpy as np
import pytest
from helpers.mm_train_cli import mm_train_command, val_losses
from helpers.train_runs import train

pytestmark = pytest.mark.distributed

SHORT = ["--set", "data.samples=32", "--set", "checkpoint.every=3", "--no-progress"]


def losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def run(run_distributed, out, steps, *extra, data, nproc=1):
    """What rank 0 printed training the default recipe into ``out`` (train_runs.train)."""
    return train(run_distributed, *SHORT, "--set", f"train.steps={steps}", "--set", f"output_dir={out}", *extra,
                 nproc=nproc, data=data)


def test_resume_same_layout_bit_exact_and_across_layouts(tmp_path, run_distributed):
    data = tmp_path / "data"
    run(run_distributed, tmp_path / "whole", 6, data=data)
    whole = losses(tmp_path / "whole")

    run(run_distributed, tmp_path / "same", 3, data=data)
    resumed = run(run_distributed, tmp_path / "same", 6, "--resume", data=data)
    assert losses(tmp_path / "same") == whole  # bit for bit
    assert f"resuming from {tmp_path / 'same' / 'checkpoints' / 'step_3'} (step 3)" in resumed

    tp2, one = (2, ["--set", "parallel.tp=2"]), (1, [])
    zero3 = (2, ["--set", "parallel.zero_stage=3", "--set", "parallel.zero3_min_numel=1024"])
    layouts = {"tp2_to_1": (tp2, one), "dp2_zero1_to_1": ((2, ["--set", "parallel.zero_stage=1"]), one),
               "dp2_zero3_to_1": (zero3, one),
               "1_to_tp2": (one, tp2), "pp2_to_1": ((2, ["--set", "parallel.pp=2"]), one)}
    for name, ((nproc_before, before), (nproc_after, after)) in layouts.items():
        printed = run(run_distributed, tmp_path / name, 3, *before, data=data, nproc=nproc_before)
        assert ("mm-train: ZeRO-3 holds 1/2 of" in printed) == (name == "dp2_zero3_to_1"), printed
        run(run_distributed, tmp_path / name, 6, "--resume", *after, data=data, nproc=nproc_after)
        got = losses(tmp_path / name)
        assert got[:3] == pytest.approx(whole[:3], rel=1e-4), name
        assert got[3:] == pytest.approx(whole[3:], rel=1e-4), name
    state = json.loads((tmp_path / "tp2_to_1" / "checkpoints" / "step_6" / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["layout"]["tp"] == 1


def fake_checkpoint(folder, manifest=True):
    from mm_train.checkpoint import write_manifest

    (folder / "model").mkdir(parents=True)
    (folder / "model" / "model.safetensors").write_bytes(b"weights" * 10)
    (folder / "trainer_state.json").write_text("{}")
    if manifest:
        write_manifest(str(folder))
    return folder


def test_only_checkpoints_whose_manifest_verifies_are_picked(tmp_path):
    from mm_train.checkpoint import find_latest, latest, verify

    root = tmp_path / "checkpoints"
    good = fake_checkpoint(root / "step_3")
    fake_checkpoint(root / "step_6", manifest=False)  # killed before its manifest
    flipped = fake_checkpoint(root / "step_9")
    (flipped / "model" / "model.safetensors").write_bytes(b"weighTs" * 10)  # same size, other bytes
    gone = fake_checkpoint(root / "step_12")
    (gone / "model" / "model.safetensors").unlink()
    (root / ".step_15.tmp").mkdir()  # interrupted while writing
    found, skipped = find_latest(str(tmp_path))
    assert found == str(good) and latest(str(tmp_path / "elsewhere")) is None
    assert skipped == [(str(gone), "model/model.safetensors is missing"),
                       (str(flipped), "model/model.safetensors does not match its sha256 in the manifest (corrupted)"),
                       (str(root / "step_6"), "no manifest.json (the save did not finish)")]
    assert verify(str(flipped), hashes=False) is None  # sizes alone do not see a flipped byte


def test_a_crash_between_the_renames_of_an_overwrite_loses_nothing(tmp_path, monkeypatch):
    """Overwriting step_N moves the old one aside first; a crash before the new one is in place
    leaves .step_N.old, which recover() puts back (and drops once step_N exists)."""
    from mm_train import checkpoint

    root = tmp_path / "checkpoints"
    old = fake_checkpoint(root / "step_3")
    new = fake_checkpoint(root / ".step_3.tmp")
    real, calls = os.replace, []

    def crash_on_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed between the two renames
        real(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        checkpoint._put_in_place(str(new), str(old))
    monkeypatch.setattr(checkpoint.os, "replace", real)
    assert not old.exists() and (root / ".step_3.old").is_dir()  # never neither
    assert checkpoint.latest(str(tmp_path)) is None
    done = checkpoint.recover(str(tmp_path))
    assert any(line.startswith("restored") for line in done) and any(".step_3.tmp" in line for line in done)
    assert sorted(os.listdir(root)) == ["step_3"] and checkpoint.latest(str(tmp_path)) == str(old)


def _run_output(stderr, out) -> str:
    """The launcher's stderr and the tail of each worker's log, for a failure message."""
    text = stderr.read_text()[-3000:]
    for log in sorted((out / "logs" / "node_0").glob("*.log")) if (out / "logs" / "node_0").is_dir() else []:
        text += f"\n--- {log.name}:\n" + log.read_text(errors="replace")[-2000:]
    return text


def _complete_checkpoints(out) -> list:
    """The run's complete checkpoints (``step_N`` folders; one being written is ``.step_N.tmp``)."""
    root = out / "checkpoints"
    return [name for name in os.listdir(root) if name.startswith("step_")] if root.is_dir() else []


def test_a_killed_worker_stops_the_run_and_resume_continues(tmp_path):
    """kill -9 of rank 1 mid-run: mm-train exits non-zero within a bounded time naming rank 1, no
    worker is left; --resume continues from the last complete checkpoint to the end, with the
    losses of an uninterrupted run."""
    import signal
    import subprocess
    import time


    data, out = tmp_path / "data", tmp_path / "killed"
    args = [mm_train_command(), "run", *SHORT, "--set", "checkpoint.every=2", "--set", "train.steps=400",
            "--nproc", "2", "--set", f"output_dir={out}"]
    # files, not pipes: a launcher blocked on a full pipe would never reach its checkpoint
    with open(tmp_path / "stdout.txt", "w") as stdout, open(tmp_path / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen(args, env={**os.environ, "MM_TRAIN_DATA": str(data)}, stdout=stdout, stderr=stderr,
                                start_new_session=True)
    try:
        start = time.time()
        # any complete checkpoint, not step_2 itself: retention may remove step_2 between two polls
        # when the machine is loaded and this loop is slow to wake
        while time.time() < start + 300 and proc.poll() is None and not _complete_checkpoints(out):
            time.sleep(0.5)
        assert proc.poll() is None and _complete_checkpoints(out), f"no checkpoint while the run was alive after " \
            f"{time.time() - start:.0f} s (exit status {proc.poll()}):\n{_run_output(tmp_path / 'stderr.txt', out)}"
        os.kill(int((out / "logs" / "node_0" / "pids" / "rank_1.pid").read_text()), signal.SIGKILL)
        killed = time.time()
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:  # never left running (with its workers) into the tests after this one
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode != 0 and time.time() - killed < 120
    assert "worker rank 1" in err and "died" in err, err[-2000:]

    steps = max(int(name.split("_")[1]) for name in os.listdir(out / "checkpoints") if name.startswith("step_"))
    run(None, out, steps + 2, "--resume", data=data)
    whole = tmp_path / "whole"
    run(None, whole, steps + 2, data=data)
    assert losses(out)[-2:] == pytest.approx(losses(whole)[-2:], rel=1e-4)


def test_virtual_pipeline_stages_train_like_one_process_and_resume_on_one(tmp_path, run_distributed):
    """PP2 x VPP2 (4 decoder layers, one per virtual stage; the interleaved schedule) gives the
    losses and validation losses of one process, and its checkpoint (one model file per virtual
    stage) resumes there."""

    # validated every 3 steps on a held-out quarter: forward passes through the virtual stages
    data = tmp_path / "data"
    deep = ["--set", "model.config.text_config.num_hidden_layers=4", "--set", "eval.every=3", "--set",
            "eval.fraction=0.25"]
    run(run_distributed, tmp_path / "single", 6, *deep, data=data)
    run(run_distributed, tmp_path / "vpp", 3, *deep, "--set", "parallel.pp=2", "--set", "parallel.vpp=2", data=data,
        nproc=2)
    assert losses(tmp_path / "vpp") == pytest.approx(losses(tmp_path / "single")[:3], rel=1e-4)
    run(run_distributed, tmp_path / "vpp", 6, *deep, "--resume", data=data)
    assert losses(tmp_path / "vpp") == pytest.approx(losses(tmp_path / "single"), rel=1e-4)
    assert val_losses(tmp_path / "vpp") == pytest.approx(val_losses(tmp_path / "single"), rel=1e-4)
    assert list(val_losses(tmp_path / "single")) == [3, 6]


def test_lora_under_zero3_equals_one_process(tmp_path, run_distributed):
    """LoRA under dp2 ZeRO-3: the frozen base weights are held as slices too (gathered for their
    matmul, no gradient reduced), the adapters train as on one process: losses and the saved
    adapters after 3 steps."""
    from safetensors.numpy import load_file

    data, outs = tmp_path / "data", {}
    for name, nproc, extra in (("one", 1, []), ("zero3", 2, ["--set", "parallel.zero_stage=3", "--set",
                                                             "parallel.zero3_min_numel=1024"])):
        outs[name] = tmp_path / name
        printed = train(run_distributed, "qwen2_5_vl_tiny_lora", *SHORT, "--set", "train.steps=3", "--set",
                        f"output_dir={outs[name]}", *extra, nproc=nproc, data=data)
    assert "mm-train: ZeRO-3 holds 1/2 of" in printed
    assert losses(outs["zero3"]) == pytest.approx(losses(outs["one"]), rel=1e-5)
    adapters = [load_file(str(outs[n] / "checkpoints" / "step_3" / "adapters" / "adapter_model.safetensors"))
                for n in ("one", "zero3")]
    assert set(adapters[0]) == set(adapters[1])
    for key, want in adapters[0].items():
        assert np.allclose(adapters[1][key], want, rtol=1e-4, atol=1e-6), key
