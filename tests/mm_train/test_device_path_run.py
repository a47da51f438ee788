"""mm-train on the Ascend path (its documented-semantics stand-ins, mm_parallel.testing): the
step's figures stay on the device until a metrics row is written (mm_train.step_rows). With
train.log_every = 3 a step reads the device not once, a written row once for all its steps'
figures, and the rows equal the CPU path's."""

import json

import pytest
from helpers.train_runs import train

from mm_train import step_rows

ARGS = ["--set", "data.samples=16", "--set", "train.steps=6", "--set", "train.log_every=3", "--set",
        "checkpoint.every=0", "--no-progress"]


def rows(out):
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_steps_on_the_device_path_read_the_host_only_when_a_row_is_written(tmp_path, monkeypatch):
    from mm_parallel.testing.device_path import ascend_stand_ins
    from mm_parallel.testing.host_transfers import host_transfers

    data = tmp_path / "data"
    train(None, *ARGS, "--set", f"output_dir={tmp_path / 'cpu'}", data=data)

    events = []  # ("add" | "write" | "written", reads so far)
    add, write = step_rows.Rows.add, step_rows.Rows.write

    def counted_add(self, figures):
        events.append(("add", seen.reads))
        add(self, figures)

    def counted_write(self, extra=None):
        events.append(("write", seen.reads))
        write(self, extra)
        events.append(("written", seen.reads))

    monkeypatch.setattr(step_rows.Rows, "add", counted_add)
    monkeypatch.setattr(step_rows.Rows, "write", counted_write)
    with ascend_stand_ins() as calls, host_transfers() as seen:
        train(None, *ARGS, "--set", f"output_dir={tmp_path / 'device'}", data=data)
    assert {"flash_attention_score", "rms_norm", "swiglu"} <= set(calls), set(calls)

    kinds = [kind for kind, _ in events]
    assert kinds == ["add"] * 3 + ["write", "written"] + ["add"] * 3 + ["write", "written"], kinds
    reads = [n for _, n in events]
    # reads between events: steps 2, 3, (row: one read for three steps' figures), steps 4, 5, 6, (row)
    assert [b - a for a, b in zip(reads, reads[1:])] == [0, 0, 0, 1, 0, 0, 0, 0, 1]

    cpu, device = rows(tmp_path / "cpu"), rows(tmp_path / "device")
    assert [r["step"] for r in device] == [r["step"] for r in cpu] == [3, 6]
    for want, got in zip(cpu, device):
        for key in ("loss", "grad_norm", "lr"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), key
        assert got["skipped"] is want["skipped"] is False
