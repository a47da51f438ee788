"""The import graph of the six packages, built from their sources: every import statement,
deferred ones inside functions too (a deferred import is still a dependency, only a later one).

- no cycle inside any package;
- mm-train's layers point one way: the registry at the bottom imports no other mm-train module;
  generic modules import no family module and no model package; the family wing imports no
  command; nothing imports the commands (cli, _worker, doctor) but themselves;
- no production module imports ``mm_parallel.testing`` (the stand-ins and the equivalence
  harness), except the doctor's check of the fused path on a CPU machine (docs/architecture.md).

The one-way direction between packages is test_packages.py's.
"""

import ast
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[2]
MODEL_PACKAGES = {"mm_models_vl", "mm_models_video"}
COMMANDS = ("mm_train.cli", "mm_train._worker", "mm_train.doctor")
# (importer, imported) pairs allowed to reach mm_parallel.testing, each with its reason in the importer
TESTING_ALLOWED = {("mm_train.doctor.kernels", "mm_parallel.testing.device_path")}


def _modules() -> Dict[str, Path]:
    found = {}
    for src in ROOT.glob("packages/*/src"):
        for path in src.rglob("*.py"):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _owner(name: str) -> str:
    """The module of ours a dotted import name lands in ("" for another package's)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imported(module: str, path: Path) -> Set[str]:
    names = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            names.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names)
    return names


def import_graph() -> Dict[str, Set[str]]:
    """{module: the modules it imports}, ours by module, other packages' by top-level name."""
    graph = {}
    for module, path in MODULES.items():
        targets = {_owner(name) or name.split(".")[0] for name in _imported(module, path)}
        graph[module] = targets - {module}
    return graph


GRAPH = import_graph()


def strongly_connected(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Tarjan's components of more than one module: each an import cycle."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _edges(rule):
    return sorted(f"{src} -> {dst}" for src, targets in GRAPH.items() for dst in targets if rule(src, dst))


def _family(module: str) -> bool:
    return module.startswith("mm_train.families")


def _command(module: str) -> bool:
    return any(module == c or module.startswith(c + ".") for c in COMMANDS)


def _generic(module: str) -> bool:
    return module.startswith("mm_train") and not _family(module)


def test_the_graph_sees_the_imports_it_checks():
    """The builder itself: deferred and relative imports are edges (a graph missing them would pass)."""
    assert "mm_train.registry" in GRAPH["mm_train.recipe"]  # deferred, inside functions
    assert "mm_parallel.comm.native" in GRAPH["mm_parallel.comm"]  # deferred
    assert "mindspore" in GRAPH["mm_parallel.comm"] and len(MODULES) > 150
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_in_any_package():
    assert strongly_connected(GRAPH) == []


def test_the_registry_is_the_bottom_of_mm_train():
    assert _edges(lambda s, d: s == "mm_train.registry" and d.startswith("mm_train")
                  and d != "mm_train.__about__") == []


def test_generic_mm_train_imports_no_family_and_no_model_package():
    assert _edges(lambda s, d: _generic(s) and (_family(d) or d.split(".")[0] in MODEL_PACKAGES)) == []


def test_nothing_imports_the_commands():
    assert _edges(lambda s, d: _command(d) and not _command(s)) == []


def test_production_code_never_imports_the_test_harness():
    def testing(module):
        return module == "mm_parallel.testing" or module.startswith("mm_parallel.testing.")

    assert _edges(lambda s, d: testing(d) and not testing(s) and (s, d) not in TESTING_ALLOWED) == []
    for importer, _ in TESTING_ALLOWED:  # each allowed place says why, beside the import
        assert "stand-ins" in MODULES[importer].read_text()


def test_mm_train_defers_only_what_it_says_and_the_cli_starts_without_mindspore():
    """Imports sit at the top of mm-train's modules except MindSpore / mm-parallel (so that `mm-train
    recipes`, `--help` and the launcher start without loading MindSpore) and the optional packages;
    a module that defers says so (a "# Deferred imports:" comment); `import mm_train.cli` loads no MindSpore."""
    import subprocess
    import sys

    deferred, silent = {}, []
    for module, path in MODULES.items():
        if not module.startswith("mm_train"):
            continue
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Import):
                        deferred.setdefault(module, set()).update(a.name for a in inner.names)
                    elif isinstance(inner, ast.ImportFrom) and inner.module:
                        deferred.setdefault(module, set()).add(inner.module)
        if module in deferred and "# Deferred imports:" not in text:
            silent.append(module)
    assert silent == []
    light = [f"{m}: {name}" for m, names in deferred.items() for name in names
             if name.split(".")[0] in sys.stdlib_module_names or
             (name.startswith("mm_train") and name not in ("mm_train", "mm_train.loop"))]
    assert light == []
    loaded = subprocess.run([sys.executable, "-c", "import sys, mm_train.cli; print(sorted(m for m in ('mindspore', "
                             "'mm_parallel', 'mm_data', 'mm_models_vl', 'mm_models_video') if m in sys.modules))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"
