"""The run resolved once: `mm-train run --nproc 2` parses its recipe file once and reads the model
folder's config.json once (preflight, the plan and the task share mm_train.model_source), then
hands its workers a run record; a worker builds the same recipe from the record without parsing
YAML or argv settings and without reading config.json again. A user's import error names the
extra to install; any other import error keeps its traceback."""

import builtins
import json

import pytest
import yaml

from mm_train import cli
from mm_train.recipe import load_recipe


@pytest.fixture
def model_folder(tmp_path):
    """A Hugging Face folder of the tiny default's model (config.json only: nothing reads weights here)."""
    folder = tmp_path / "model"
    folder.mkdir()
    config = load_recipe("qwen2_5_vl_tiny").model.config
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", **config}))
    return folder


def counting(monkeypatch):
    """{"recipes": recipe files yaml.safe_load parsed, "config.json": opens of a config.json}."""
    counts = {"recipes": [], "config.json": 0}
    safe_load, real_open = yaml.safe_load, builtins.open

    def counted_load(stream):
        counts["recipes"].append(getattr(stream, "name", "<text>"))
        return safe_load(stream)

    def counted_open(file, *args, **kwargs):
        counts["config.json"] += str(file).endswith("config.json")
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(yaml, "safe_load", counted_load)
    monkeypatch.setattr(builtins, "open", counted_open)
    return counts


def test_the_launcher_resolves_the_run_once_and_workers_load_its_record(tmp_path, monkeypatch, model_folder):
    import mm_parallel.launch

    launched = {}

    def fake_launch(script, nproc, args, **kwargs):  # msrun is not started: the record is what it would carry
        launched.update(script=script, nproc=nproc, args=args)
        return kwargs["log_dir"]

    monkeypatch.setattr(mm_parallel.launch, "launch", fake_launch)
    sets = [f"model.path={model_folder}", "model.config={}", f"output_dir={tmp_path / 'out'}", "train.steps=3"]
    counts = counting(monkeypatch)
    argv = ["run", "qwen2_5_vl_tiny", "--nproc", "2", "--no-progress"] + [a for s in sets for a in ("--set", s)]
    assert cli.main(argv) == 0
    recipes = [name for name in counts["recipes"] if name.endswith(".yaml") and "recipes" in name]
    assert len(recipes) == 1 and recipes[0].endswith("qwen2_5_vl_tiny.yaml"), counts
    assert counts["config.json"] == 1, counts
    assert launched["nproc"] == 2 and launched["script"].name == "_worker.py"
    flag, record = launched["args"]
    assert flag == "--run-record"

    expected = load_recipe("qwen2_5_vl_tiny", sets).to_dict()
    monkeypatch.setattr(yaml, "safe_load", lambda stream: pytest.fail(f"a worker parsed YAML: {stream!r}"))
    counts["config.json"] = 0
    recipe, options = cli.recorded_run(record)
    assert counts["config.json"] == 0
    assert recipe.to_dict() == expected
    assert options == {"progress": False, "resume": False, "resume_from": None, "overwrite": False}


def test_only_a_missing_extra_is_turned_into_the_install_hint(monkeypatch, capsys):
    def missing(name):
        def run(args):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return run

    monkeypatch.setattr(cli, "_recipes", missing("mm_models_video"))
    assert cli.main(["recipes"]) == 2
    assert "pip install 'mm-train[video]'" in capsys.readouterr().err
    monkeypatch.setattr(cli, "_recipes", missing("mm_train.no_such_module"))  # a bug, not an extra
    with pytest.raises(ModuleNotFoundError, match="no_such_module"):
        cli.main(["recipes"])
