"""A step whose loss is not finite is skipped (no update) and counted; max_nonfinite_steps in a
row stop the run with an error that says what to change. NaN pixels are injected into chosen
steps' batches (in process, one worker)."""

import json

import numpy as np
import pytest


def poisoned_run(tmp_path, monkeypatch, bad_steps, steps, *extra):
    from mm_train import loop
    from mm_train.families.vl.qwen2_5_vl import VLTask
    from mm_train.recipe import load_recipe

    real_stream = VLTask.stream

    def stream(self, first_step):
        for step, batches in enumerate(real_stream(self, first_step), first_step):
            if step in bad_steps:
                for batch in batches:
                    batch["pixel_values"] = batch["pixel_values"] * np.float32("nan")
            yield batches

    monkeypatch.setattr(VLTask, "stream", stream)
    recipe = load_recipe(None, [f"train.steps={steps}", "data.samples=32", f"data.path={tmp_path / 'data'}",
                                f"output_dir={tmp_path / 'out'}", *extra])
    return loop.train(recipe, progress=False)


def saved_tensors(folder):
    """Every tensor of a checkpoint: the model's weights and the optimizer's state, by file and name."""
    from safetensors.numpy import load_file

    return {f"{path.relative_to(folder)}:{name}": value for path in sorted(folder.rglob("*.safetensors"))
            for name, value in load_file(str(path)).items()}


def test_a_nan_step_is_skipped_without_any_update_and_training_goes_on(tmp_path, monkeypatch):
    metrics = poisoned_run(tmp_path, monkeypatch, {1}, 4, "checkpoint.every=1", "checkpoint.keep=0")
    assert [m["skipped"] for m in metrics] == [False, True, False, False]
    assert metrics[1]["loss"] is None and all(m["loss"] is not None for m in metrics[2:])
    rows = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert rows[1]["loss"] is None and rows[3]["loss"] < rows[0]["loss"]
    # the checkpoints after steps 1, 2 (skipped) and 3: weights, master weights and Adam moments
    # unchanged by the skipped step, changed by the next one
    before, skipped, after = (saved_tensors(tmp_path / "out" / "checkpoints" / f"step_{n}") for n in (1, 2, 3))
    assert before.keys() == skipped.keys() and len(before) > 10
    assert all(np.array_equal(before[k], skipped[k]) for k in before)
    assert not all(np.array_equal(skipped[k], after[k]) for k in before)


def test_too_many_nan_steps_in_a_row_stop_the_run(tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match="3 steps in a row .* non-finite"):
        poisoned_run(tmp_path, monkeypatch, bad_steps={2, 3, 4, 5}, steps=8)
