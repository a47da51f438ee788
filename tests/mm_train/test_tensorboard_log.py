"""logging.tensorboard: the rows of metrics.jsonl as TensorBoard events (tensorboardX writes them),
read back with TensorBoard's own reader; a resumed run's events do not double back; the extra's
absence is refused before launch."""

import json

import pytest
from helpers.mm_train_cli import toy_cli


def _scalars(folder, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return events, [(e.step, e.value) for e in events.Scalars(tag)]


def test_tensorboard_events_hold_the_metrics_rows_and_a_resume_does_not_double_them(tmp_path):
    out = tmp_path / "run"
    common = ["--set", f"output_dir={out}", "--set", "model.config.experts=4", "--set", "logging.tensorboard=true"]
    result = toy_cli("run", "toy_tiny", *common, "--set", "checkpoint.every=3")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events, losses = _scalars(out / "tensorboard", "train/loss")
    assert losses == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows]
    tags = set(events.Tags()["scalars"])
    assert {"train/lr", "train/grad_norm", "train/samples_per_s", "train/mfu", "train/mem_bytes"} <= tags
    assert {"moe/layers.0.mlp/imbalance", "moe/layers.1.mlp/aux_loss"} <= tags
    first = losses
    resumed = toy_cli("run", "toy_tiny", *common, "--resume-from", str(out / "checkpoints" / "step_3"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _, losses = _scalars(out / "tensorboard", "train/loss")
    assert [step for step, _ in losses] == [1, 2, 3, 4, 5, 6]  # steps 4-6 of the first attempt purged
    assert [v for _, v in losses] == pytest.approx([v for _, v in first], rel=1e-4)


def test_tensorboard_without_its_extra_is_refused_before_launch(monkeypatch):
    from mm_train import tensorboard_log
    from mm_train.preflight import check_before_launch
    from mm_train.recipe import load_recipe

    monkeypatch.setattr(tensorboard_log, "available", lambda: False)
    with pytest.raises(ValueError, match=r"pip install 'mm-train\[tensorboard\]'"):
        check_before_launch(load_recipe("wan2_1_t2v_tiny", ["logging.tensorboard=true"]))
    check_before_launch(load_recipe("wan2_1_t2v_tiny"))
