"""DESIGN §2 contracts: the import graph, sibling version ranges, mm-parallel standing alone."""

import ast
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "mm-parallel": "mm_parallel",
    "mm-data": "mm_data",
    "mm-profiling": "mm_profiling",
    "mm-models-vl": "mm_models_vl",
    "mm-models-video": "mm_models_video",
    "mm-train": "mm_train",
}
# Which siblings each package may import (the one-way dependency direction of DESIGN §2).
ALLOWED = {
    "mm_parallel": set(),
    "mm_data": set(),
    "mm_profiling": set(),
    "mm_models_vl": {"mm_parallel", "mm_profiling"},  # mm_profiling: FLOPs formula helpers
    "mm_models_video": {"mm_parallel", "mm_profiling"},
    "mm_train": {"mm_parallel", "mm_data", "mm_profiling", "mm_models_vl", "mm_models_video"},
}
MODULE_TO_PACKAGE = {module: package for package, module in PACKAGES.items()}


def pyproject(package):
    return tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())


def version(package):
    about = ROOT / "packages" / package / "src" / PACKAGES[package] / "__about__.py"
    return re.search(r'__version__ = "([^"]+)"', about.read_text()).group(1)


def imported_top_modules(module):
    found = {}
    for path in (ROOT / "packages" / MODULE_TO_PACKAGE[module] / "src" / module).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_package_has_the_layout():
    for package, module in PACKAGES.items():
        folder = ROOT / "packages" / package
        for needed in ("pyproject.toml", "README.md", "CHANGELOG.md", f"src/{module}/__about__.py",
                       f"src/{module}/__init__.py"):
            assert (folder / needed).exists(), f"{package} lacks {needed}"
        assert pyproject(package)["project"]["name"] == package
        changelog = (folder / "CHANGELOG.md").read_text()
        assert version(package) in changelog, f"{package}: CHANGELOG has no entry for its version"


@pytest.mark.parametrize("module", sorted(ALLOWED))
def test_import_graph_is_one_way(module):
    imports = imported_top_modules(module)
    siblings = {m for m in imports if m in MODULE_TO_PACKAGE and m != module}
    forbidden = siblings - ALLOWED[module]
    assert not forbidden, {m: imports[m] for m in forbidden}


def test_mm_data_never_imports_mindspore():
    imports = imported_top_modules("mm_data")
    assert "mindspore" not in imports, imports.get("mindspore")
    code = "import sys, mm_data; assert not [m for m in sys.modules if m.startswith('mindspore')]"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("module", sorted(ALLOWED))
def test_sibling_imports_are_declared(module):
    package = MODULE_TO_PACKAGE[module]
    project = pyproject(package)["project"]
    declared = [Requirement(r) for r in project.get("dependencies", [])]
    for extra in project.get("optional-dependencies", {}).values():
        declared += [Requirement(r) for r in extra]
    declared_names = {canonicalize_name(r.name) for r in declared}
    for sibling in set(imported_top_modules(module)) & set(MODULE_TO_PACKAGE):
        if sibling != module:
            assert canonicalize_name(MODULE_TO_PACKAGE[sibling]) in declared_names, f"{package} imports {sibling}"


def test_every_sibling_range_is_satisfied():
    versions = {canonicalize_name(p): version(p) for p in PACKAGES}
    checked = 0
    for package in PACKAGES:
        project = pyproject(package)["project"]
        requirements = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            requirements += extra
        for text in requirements:
            req = Requirement(text)
            name = canonicalize_name(req.name)
            if name in versions:
                checked += 1
                assert req.specifier.contains(versions[name]), f"{package} needs {text}, sibling is {versions[name]}"
    assert checked >= 9  # models x2, train core + 4 extras + the 'all' extra's four


def test_mm_train_extras():
    extras = pyproject("mm-train")["project"]["optional-dependencies"]
    # the trackers (mm_train.trackers) are extras of their own, left out of "all" (the training stack)
    assert set(extras) == {"video", "vl", "data", "profiling", "tensorboard", "all", "wandb", "swanlab", "mlflow"}
    everything = {canonicalize_name(Requirement(r).name) for r in extras["all"]}
    for name in ("video", "vl", "data", "profiling", "tensorboard"):
        assert {canonicalize_name(Requirement(r).name) for r in extras[name]} <= everything


@pytest.mark.slow
def test_mm_parallel_wheel_installs_alone_in_a_fresh_venv(tmp_path):
    """Build the wheel, install it into a new venv that sees its dependencies but no sibling."""
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
         str(ROOT / "packages" / "mm-parallel")],
        check=True,
    )
    (wheel,) = dist.glob("mm_parallel-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        tops = {n.split("/")[0] for n in zf.namelist()}
        metadata = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert {t for t in tops if not t.endswith(".dist-info")} == {"mm_parallel"}
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert {canonicalize_name(Requirement(r).name) for r in requires} == {"mindspore", "numpy", "safetensors"}

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    venv_site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    # The heavy dependencies (mindspore, numpy) come from this environment's site-packages, added as
    # a plain path: its .pth files (the editable siblings) are not processed, so no sibling is visible.
    (Path(venv_site) / "shared_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", str(wheel)], check=True)
    check = (
        "import sys, importlib.util, mm_parallel, mm_parallel.comm, mm_parallel.mappings\n"
        "import mm_parallel.launch, mm_parallel.testing\n"
        f"assert mm_parallel.__file__.startswith({str(venv)!r}), mm_parallel.__file__\n"
        "assert mm_parallel.ParallelConfig(tp=2).tp == 2\n"
        "for sibling in ('mm_data', 'mm_profiling', 'mm_models_vl', 'mm_models_video', 'mm_train'):\n"
        "    assert importlib.util.find_spec(sibling) is None, sibling\n"
        "print(mm_parallel.__version__)\n"
    )
    out = subprocess.run([str(python), "-c", check], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == version("mm-parallel")


@pytest.mark.slow
def test_mm_train_all_installs_from_the_wheels_and_trains(tmp_path):
    """Every package's wheel built; `pip install mm-train[all]` from those wheels into a fresh venv
    (third-party dependencies from this environment, as above); there `mm-train recipes` lists the
    built-in recipes and a built-in tiny recipe trains two steps: recipes and data files ship in the
    wheels, the console script works, no source checkout is needed."""
    dist = tmp_path / "dist"
    for package in PACKAGES:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(dist), str(ROOT / "packages" / package)], check=True)
    assert len(list(dist.glob("*.whl"))) == len(PACKAGES)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python, command = venv / "bin" / "python", venv / "bin" / "mm-train"
    venv_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip()
    (Path(venv_site) / "shared_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # every wheel by its path (this environment's editable siblings would satisfy the names), mm-train
    # with its [all] extra, which the other wheels must fulfil
    wheels = [str(w) + ("[all]" if w.name.startswith("mm_train-") else "") for w in sorted(dist.glob("*.whl"))]
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", "--find-links", str(dist), *wheels],
                   check=True)
    where = subprocess.run([str(python), "-c", "import mm_parallel, mm_train, mm_models_vl, mm_models_video, mm_data, "
                            "mm_profiling as m; print(mm_train.__file__, m.__file__, mm_parallel.__file__)"],
                           check=True, capture_output=True, text=True, cwd=tmp_path).stdout.split()
    assert all(path.startswith(str(venv)) for path in where), where
    listed = subprocess.run([str(command), "recipes"], capture_output=True, text=True, cwd=tmp_path)
    assert listed.returncode == 0 and "qwen2_5_vl_tiny" in listed.stdout and "wan2_1_t2v_tiny" in listed.stdout, \
        listed.stderr[-2000:]
    run = subprocess.run([str(command), "run", "qwen2_5_vl_tiny", "--no-progress", "--set", "train.steps=2",
                          "--set", "data.samples=16", "--set", f"data.path={tmp_path / 'data'}",
                          "--set", f"output_dir={tmp_path / 'out'}"], capture_output=True, text=True, cwd=tmp_path,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()) == 2
