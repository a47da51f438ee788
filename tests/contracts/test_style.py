"""What a maintainer expects of the tree: ruff clean (ruff.toml: line length, import order,
pyflakes), each package's version stated alike in its __about__, its README status line and the
root README's table, no private names imported across packages, kernel switches read once."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"mm-parallel": "mm_parallel", "mm-data": "mm_data", "mm-profiling": "mm_profiling",
            "mm-models-vl": "mm_models_vl", "mm-models-video": "mm_models_video", "mm-train": "mm_train"}


def test_ruff_is_clean():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True,
                            text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def version(package):
    about = ROOT / "packages" / package / "src" / PACKAGES[package] / "__about__.py"
    return re.search(r'__version__ = "([^"]+)"', about.read_text()).group(1)


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_version_agrees_in_about_readme_and_root_table(package):
    want = version(package)
    readme = (ROOT / "packages" / package / "README.md").read_text()
    assert re.findall(r"\*\*Status \(([^)]+)\):\*\*", readme) == [want], f"{package}/README.md status line"
    row = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith(f"| [{package}]"))
    assert row.split("|")[3].strip().startswith(f"{want}:"), f"root README row of {package}: {row}"


def test_no_private_names_cross_packages():
    offenders = []
    for package, module in PACKAGES.items():
        for path in (ROOT / "packages" / package / "src").rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    top = node.module.split(".")[0]
                    if top in PACKAGES.values() and top != module:
                        private = [a.name for a in node.names if a.name.startswith("_")]
                        private += [part for part in node.module.split(".") if part.startswith("_")]
                        if private:
                            offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.module} {private}")
    assert not offenders


def test_kernel_switches_are_read_once():
    """Environment switches are read when a module loads (or into a cached setting), not on
    every kernel call."""
    calls = []
    for path in (ROOT / "packages" / "mm-parallel" / "src" / "mm_parallel" / "ops").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for function in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
            text = ast.get_source_segment(path.read_text(), function) or ""
            if "os.environ" in text and "lru_cache" not in "".join(ast.unparse(d) for d in function.decorator_list):
                calls.append(f"{path.name}:{function.name}")
    assert not calls


def test_the_public_names_design_lists_exist():
    """DESIGN §3's names for mm-parallel and the wave-2 shared modules, as users call them."""
    import mm_parallel

    for name in ("ParallelConfig", "initialize", "Topology", "Group", "comm", "mappings", "ColumnParallelLinear",
                 "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy", "attention",
                 "DistributedOptimizer", "recompute", "lora", "sharding", "stage_io", "model_base", "moe", "MoELayer"):
        assert hasattr(mm_parallel, name), name
    for name in ("TopKRouter", "AllToAllDispatcher", "AllGatherDispatcher", "GroupedExperts", "MoELayer", "MoEConfig",
                 "auxiliary_loss", "routing_metrics", "update_expert_biases"):
        assert hasattr(mm_parallel.moe, name), name
    for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_v", "broadcast", "send",
                 "recv"):
        assert callable(getattr(mm_parallel.comm, name)), name
    assert callable(mm_parallel.lora.apply_lora) and callable(mm_parallel.lora.merge_lora)
    from mm_train import registry

    assert callable(registry.get) and registry.FamilySpec
