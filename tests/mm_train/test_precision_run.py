"""`mm-train run` in bf16 and fp16: the built-in default trains in bf16 with falling loss and
writes bf16 checkpoints (config.json says so, the optimizer state stays fp32); resuming a bf16 run
is bit-exact; bf16 under ZeRO-3 equals ZeRO-1 to the bit; fp16's dynamic loss scaling skips
overflowing steps, halves the scale and grows it again; bad precision settings are refused before
launch."""

import json
import os
import re
import shutil

import pytest
from helpers.mm_train_cli import mm_train
from helpers.train_runs import train

pytestmark = pytest.mark.distributed

SHORT = ["--set", "data.samples=32", "--no-progress"]


def rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def dtypes(file):
    """{tensor: safetensors dtype} from a file's header."""
    with open(file, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}


def run(out, *extra, data):
    """The default recipe trained into ``out`` in this process, as a worker runs it (train_runs)."""
    return train(None, *SHORT, "--set", f"output_dir={out}", *extra, data=data)


def test_bf16_trains_saves_bf16_and_resumes_bit_exact(tmp_path):
    from mm_parallel.ops import low_precision

    data, whole = tmp_path / "data", tmp_path / "whole"
    bf16 = ["--set", "train.precision=bf16", "--set", "checkpoint.every=2", "--set", "checkpoint.keep=2"]
    run(whole, *bf16, "--set", "train.steps=4", data=data)
    assert low_precision.compute_dtype() == low_precision.ms.float32  # the run leaves the process as it found it
    losses = [r["loss"] for r in rows(whole)]
    assert losses[-1] < losses[0]
    step = whole / "checkpoints" / "step_4"
    assert set(dtypes(step / "model" / "model.safetensors").values()) == {"BF16"}
    assert json.loads((step / "model" / "config.json").read_text())["dtype"] == "bfloat16"
    assert set(dtypes(step / "optimizer-stage000.safetensors").values()) == {"F32"}  # master and moments

    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_4")
    run(resumed, *bf16, "--set", "train.steps=4", "--resume", data=data)
    assert [r["loss"] for r in rows(resumed)] == losses
    for name in ("model/model.safetensors", "optimizer-stage000.safetensors"):
        assert (resumed / "checkpoints" / "step_4" / name).read_bytes() == (step / name).read_bytes(), name

    run(tmp_path / "fp32_save", "--set", "train.precision=bf16", "--set", "train.steps=1", "--set",
        "checkpoint.every=1", "--set", "checkpoint.save_dtype=fp32", data=data)
    saved = tmp_path / "fp32_save" / "checkpoints" / "step_1" / "model"
    assert set(dtypes(saved / "model.safetensors").values()) == {"F32"}
    assert json.loads((saved / "config.json").read_text())["dtype"] == "float32"


def test_bf16_zero3_and_offload_equal_zero1_at_the_same_dp_and_save_bf16(tmp_path, run_distributed):
    """ZeRO-3 in bf16: each weight's float32 slice is rounded to bf16 for the matmul and each
    rank's weight gradient to bf16 before the float32 sum, as the whole bf16 weight's path does:
    dp2 ZeRO-3 equals dp2 ZeRO-1 to the bit, losses and saved weights (bf16, like ZeRO-1's); so
    does ZeRO-3 with the optimizer state and the activations in host memory (optim.offload,
    train.activation_offload)."""
    data = tmp_path / "data"
    bf16 = [*SHORT, "--set", "train.precision=bf16", "--set", "train.steps=3", "--set", "checkpoint.every=3"]
    zero3 = ["--set", "parallel.zero_stage=3", "--set", "parallel.zero3_min_numel=1024"]
    for name, stage in (("zero1", ["--set", "parallel.zero_stage=1"]), ("zero3", zero3),
                        ("offloaded", zero3 + ["--set", "optim.offload=optimizer", "--set",
                                               "train.activation_offload=true"])):
        printed = train(run_distributed, *bf16, *stage, "--set", f"output_dir={tmp_path / name}", nproc=2, data=data)
    moved = re.search(r"activation offload moved ([\d,.]+) MiB", printed)
    assert moved and float(moved.group(1).replace(",", "")) > 0, printed[-2000:]
    model = os.path.join("checkpoints", "step_3", "model", "model.safetensors")
    for name in ("zero3", "offloaded"):
        assert [r["loss"] for r in rows(tmp_path / name)] == [r["loss"] for r in rows(tmp_path / "zero1")], name
        assert set(dtypes(tmp_path / name / model).values()) == {"BF16"}
        assert (tmp_path / name / model).read_bytes() == (tmp_path / "zero1" / model).read_bytes(), name


def test_fp16_loss_scaling_skips_overflows_and_grows_back(tmp_path):
    # 2^20 times the loss overflows fp16's gradients (max 65504) here until the scale has halved a few
    # times (measured: 2^18 overflows, 2^17 does not); two clean steps double it again
    run(tmp_path / "fp16", "--set", "train.precision=fp16", "--set", "train.steps=10", "--set",
        "optim.initial_loss_scale=1048576", "--set", "optim.loss_scale_window=2", data=tmp_path / "data")
    got = rows(tmp_path / "fp16")
    scales = [r["loss_scale"] for r in got]
    assert got[0]["skipped"] and scales[0] == 2 ** 19 and got[0]["grad_norm"] is None
    assert all(scales[i] == scales[i - 1] / 2 for i in range(1, len(got)) if got[i]["skipped"])
    assert any(not r["skipped"] for r in got)
    assert any(scales[i] == 2 * scales[i - 1] for i in range(1, len(got)))  # grown after two clean steps
    assert got[-1]["skipped_total"] == sum(r["skipped"] for r in got)
    assert all(r["loss"] is not None for r in got)


def test_bad_precision_settings_are_refused_before_launch(tmp_path):
    for setting, message in (("train.precision=fp8", "train.precision must be bf16, fp16 or fp32"),
                             ("train.grad_dtype=fp16", "train.grad_dtype must be fp32 or the run's precision"),
                             ("checkpoint.save_dtype=int8", "checkpoint.save_dtype must be fp32, bf16 or fp16")):
        result = mm_train("run", "--nproc", "2", "--set", setting, data=tmp_path / "data")
        assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "data").exists()
