"""mm-train with none of its extras: only the mm-parallel and mm-train wheels in a fresh venv (their
own dependencies from this environment, no sibling visible). `mm-train recipes` lists every built-in
recipe (the families come from the wheel's entry points and import without their model packages),
and a run of a family whose package is missing stops before any process starts, naming the extra
to install."""

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory):
    """(the venv's mm-train command, a work folder): mm-parallel and mm-train installed from wheels."""
    tmp = tmp_path_factory.mktemp("bare")
    dist = tmp / "dist"
    for package in ("mm-parallel", "mm-train"):
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(dist), str(ROOT / "packages" / package)], check=True)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # this environment's packages as a plain path: its .pth files (the editable siblings) are not read
    (Path(site) / "shared_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    wheels = [str(wheel) for wheel in dist.glob("*.whl")]
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", "--no-deps", *wheels], check=True)
    siblings = subprocess.run([str(python), "-c", "import importlib.util as u; print([m for m in ('mm_data', "
                               "'mm_profiling', 'mm_models_vl', 'mm_models_video') if u.find_spec(m)])"],
                              check=True, capture_output=True, text=True, cwd=tmp).stdout.strip()
    assert siblings == "[]"
    return venv / "bin" / "mm-train", tmp


def test_the_recipes_are_listed_without_any_extra(bare_venv):
    command, work = bare_venv
    listed = subprocess.run([str(command), "recipes"], capture_output=True, text=True, cwd=work, timeout=300)
    assert listed.returncode == 0, listed.stderr[-2000:]
    from mm_train import registry

    for _, recipe in registry.recipes():  # this environment's registry: the same entry points
        assert recipe.name in listed.stdout


@pytest.mark.parametrize("recipe, extra", [("qwen2_5_vl_tiny", "vl"), ("wan2_1_t2v_tiny", "video")])
def test_a_run_without_its_family_extra_names_the_extra(bare_venv, recipe, extra):
    command, work = bare_venv
    run = subprocess.run([str(command), "run", recipe, "--no-progress", "--set", f"output_dir={work / recipe}"],
                         capture_output=True, text=True, cwd=work, timeout=300)
    assert run.returncode == 2, run.stderr[-3000:]
    assert f"pip install 'mm-train[{extra}]'" in run.stderr and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert not (work / recipe / "metrics.jsonl").exists()


def test_the_cli_knows_every_extra():
    """The modules the CLI maps to extras are the extras pyproject.toml declares."""
    from mm_train.cli import EXTRAS

    extras = tomllib.loads((ROOT / "packages/mm-train/pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(EXTRAS.values()) == set(extras) - {"all"}
