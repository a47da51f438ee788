"""logging.wandb / swanlab / mlflow: the rows of metrics.jsonl, the recipe and the validation
samples reach each tracker, read back through each library's own store — MLflow through
MlflowClient, SwanLab through its local dashboard's store (runs.swanlab and its logs), W&B (no
reader for offline runs) through the calls recorded at its API plus the offline run's files; a
missing extra is refused before launch."""

import glob
import json
import os
import sqlite3
from pathlib import Path

import pytest
from helpers.mm_train_cli import mm_train

RECIPE = str(Path(__file__).resolve().parents[2] / "packages/mm-train/src/mm_train/recipes/wan2_1_t2v_tiny.yaml")
# W&B's offline files need its own service to read back: record the calls at its API instead
RECORDER = """
import json, os
import wandb.sdk.wandb_run as run_module

_log = run_module.Run.log


def log(self, data, step=None, **kwargs):
    with open(os.environ["MM_TEST_WANDB_CALLS"], "a") as f:
        kinds = {k: v if isinstance(v, (int, float)) else type(v).__name__ for k, v in data.items()}
        f.write(json.dumps({"step": step, "data": kinds}) + "\\n")
    return _log(self, data, step=step, **kwargs)


run_module.Run.log = log
"""


def _swanlab_history(folder, tag):
    """(step, value) of ``tag`` from SwanLab's local store: the dashboard's tag table names the
    folder of the tag's log lines."""
    database = sqlite3.connect(os.path.join(folder, "runs.swanlab"))
    (where,) = database.execute("select folder from tag where name = ?", (tag,)).fetchone()
    run = glob.glob(os.path.join(folder, "run-*"))[0]
    lines = [json.loads(line) for path in sorted(glob.glob(os.path.join(run, "logs", where, "*.log")))
             for line in Path(path).read_text().splitlines()]
    return [(line["index"], line["data"]) for line in lines], {name: kind for name, kind in
                                                              database.execute("select name, type from tag")}


def test_trackers_get_the_metrics_rows_the_recipe_and_the_samples(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(RECORDER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("MM_TEST_WANDB_CALLS", str(tmp_path / "wandb_calls.jsonl"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the run opts in to its file store itself
    out = tmp_path / "run"
    result = mm_train("run", RECIPE, "--set", f"data.path={tmp_path / 'tiny_video'}", "--set", f"output_dir={out}",
                      "--set", "train.steps=4", "--set", "eval.sample_every=4", "--set", "eval.steps=2", "--set",
                      "eval.prompts=[a red square]", "--set", "logging.mlflow=true", "--set",
                      "logging.wandb={mode: offline, project: tracked}", "--set", "logging.swanlab={mode: local}",
                      "--no-progress", data=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [(row["step"], pytest.approx(row["loss"], rel=1e-6)) for row in rows]

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for this reader
    client = MlflowClient(tracking_uri="file:" + str(out / "mlruns"))
    experiment = client.get_experiment_by_name("mm-train")
    (run,) = client.search_runs([experiment.experiment_id])
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")] == losses
    assert {"train/lr", "train/grad_norm", "train/samples_per_s"} <= set(run.data.metrics)
    assert run.data.params["train.steps"] == "4" and run.info.run_name == "run"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert "recipe.json" in artifacts and any(a.startswith("images") for a in artifacts), artifacts

    history, tags = _swanlab_history(out / "swanlog", "train/loss")
    assert history == losses and any(n.startswith("samples/") and kind == "image" for n, kind in tags.items())

    calls = [json.loads(line) for line in (tmp_path / "wandb_calls.jsonl").read_text().splitlines()]
    assert [(c["step"], c["data"]["train/loss"]) for c in calls if "train/loss" in c["data"]] == losses
    assert any(kind == "Image" and name.startswith("samples/") for c in calls for name, kind in c["data"].items())
    assert glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert json.loads((out / "trackers.json").read_text())["mlflow"] == run.info.run_id


def test_a_tracker_without_its_extra_is_refused_before_launch(monkeypatch):
    import importlib.util

    from mm_train.preflight import check_before_launch
    from mm_train.recipe import load_recipe

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ValueError, match=r"logging.mlflow needs mlflow: pip install 'mm-train\[mlflow\]'"):
        check_before_launch(load_recipe("wan2_1_t2v_tiny", ["logging.mlflow=true"]))
    with pytest.raises(ValueError, match="logging.wandb.mode 'shared': use online or offline"):
        load_recipe("wan2_1_t2v_tiny", ["logging.wandb={mode: shared}"])
