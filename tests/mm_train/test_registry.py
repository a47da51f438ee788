"""The family registry: a third family defined only in the test suite (tests/helpers/toy_family)
is listed by `mm-train recipes`, trains through `mm-train run NAME` on one process and equals it
under tp2 and pp2, and its checkpoint converts — with no edit anywhere in mm-train. Generic
mm-train code names no family."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from helpers.mm_train_cli import mm_train_command, toy_cli

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "packages" / "mm-train" / "src" / "mm_train"
FAMILY_WORDS = re.compile(r"qwen|cogvideo|\bwan(2|_|\b)|umt5|llamafactory|tiny_vl|tiny_video", re.I)


def losses(out):
    return [json.loads(line)["loss"] for line in open(out / "metrics.jsonl")]


def test_generic_code_names_no_family():
    # every module outside the family wing; plan/search.py's docstring quotes a measured search of a real model
    generic = [p for p in TRAIN.rglob("*.py") if "families" not in p.parts and p.name != "search.py"]
    generic += list((ROOT / "packages" / "mm-profiling" / "src").rglob("*.py"))
    named = {str(p.relative_to(ROOT)): [m.group(0) for m in FAMILY_WORDS.finditer(p.read_text())] for p in generic}
    assert not {p: words for p, words in named.items() if words}


def test_the_registry_knows_the_builtin_families_and_finds_recipes_by_name():
    from mm_train import registry
    from mm_train.recipe import load_recipe

    known = registry.families()
    assert {"qwen2_5_vl", "wan"} <= set(known)
    for spec, recipe in registry.recipes():
        assert recipe.path.is_file(), recipe
        assert load_recipe(recipe.name).model.family == spec.name
    assert sum(r.default for _, r in registry.recipes()) == 1
    with pytest.raises(FileNotFoundError, match="mm-train recipes"):
        load_recipe("no_such_recipe")


def test_a_spec_holds_objects_and_its_model_package_references_import():
    """Everything of mm-train's own in a FamilySpec is an object; the "module:attribute" strings
    left name the optional model package (models, plan, LoRA config), and each imports."""
    import inspect

    from mm_train import registry

    for spec in registry.families().values():
        assert inspect.isclass(spec.task) and all(inspect.isclass(c) for c in spec.data_sections.values())
        for hook in (spec.processing, spec.preflight, spec.workload, spec.generate):
            assert hook is None or callable(hook), (spec.name, hook)
        for reference in [*spec.models.values(), spec.plan, spec.lora_config]:
            assert reference.split(":")[0].split(".")[0] in ("mm_models_vl", "mm_models_video", "helpers"), reference
            assert registry.resolve(reference, spec.extra) is not None
        assert callable(spec.plan_function()) and inspect.isclass(spec.lora_config_class())


@pytest.mark.distributed
def test_a_family_from_the_test_suite_trains_through_mm_train_run(tmp_path):
    listed = toy_cli("recipes")
    assert listed.returncode == 0 and re.search(r"toy_tiny\s+toy_mlp", listed.stdout), listed.stdout + listed.stderr
    runs = {"single": [], "tp2": ["--nproc", "2", "--set", "parallel.tp=2"],
            "pp2": ["--nproc", "2", "--set", "parallel.pp=2"]}
    got = {}
    for name, extra in runs.items():
        out = tmp_path / name
        result = toy_cli("run", "toy_tiny", "--no-progress", "--set", f"output_dir={out}", "--set",
                         "checkpoint.every=6",
                         *extra)
        assert result.returncode == 0, result.stderr[-3000:]
        got[name] = losses(out)
    assert got["single"][-1] < got["single"][0]
    for name in runs:
        assert got[name] == pytest.approx(got["single"], rel=1e-4), (name, got)
    export = toy_cli("convert", "checkpoint", str(tmp_path / "tp2" / "checkpoints" / "step_6"), str(tmp_path / "out"))
    assert export.returncode == 0, export.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "toy_mlp"


def test_moe_routing_metrics_reach_metrics_jsonl_and_ep2_trains_as_one_process(tmp_path):
    """The toy family with MoE blocks (top 2 of 4 experts): each step's row carries every MoE
    layer's figures; under ep2 (dp2) the losses equal one process's; convert rewrites its experts."""
    from mm_parallel.hf_checkpoint import SafetensorsFolder
    from mm_parallel.moe.checkpoint import LAYOUTS
    from mm_train.convert import EXPERT_LAYOUTS

    assert EXPERT_LAYOUTS == LAYOUTS
    got = {}
    for name, extra in {"single": [], "ep2": ["--nproc", "2", "--set", "parallel.ep=2"]}.items():
        out = tmp_path / name
        result = toy_cli("run", "toy_tiny", "--set", f"output_dir={out}", "--set", "model.config.experts=4",
                         "--set", "checkpoint.every=6", *extra)
        assert result.returncode == 0, result.stderr[-3000:]
        got[name] = losses(out)
        row = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
        assert sorted(row["moe"]) == ["layers.0.mlp", "layers.1.mlp"], row
        layer = row["moe"]["layers.0.mlp"]
        assert len(layer["tokens_per_expert"]) == 4 and layer["imbalance"] >= 1.0 and layer["dropped_fraction"] == 0
        assert layer["aux_loss"] > 0 and layer["z_loss"] > 0
        if name == "single":
            assert "moe imbalance" in result.stderr, result.stderr[-2000:]
    assert got["ep2"] == pytest.approx(got["single"], rel=1e-4)
    model = tmp_path / "ep2" / "checkpoints" / "step_6" / "model"
    done = toy_cli("convert", "experts", str(model), str(tmp_path / "per_expert"), "--layout", "per_expert")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "layers.1.mlp.experts.3.down_proj.weight" in SafetensorsFolder(str(tmp_path / "per_expert")).names()


def test_a_family_module_that_cannot_be_imported_is_named():
    env = {**os.environ, "MM_TRAIN_FAMILIES": "no_such_family_module"}
    result = subprocess.run([mm_train_command(), "recipes"], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "MM_TRAIN_FAMILIES names 'no_such_family_module'" in result.stderr, result.stderr
