"""CI runs the README's test command, and nothing pickles."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_test_command():
    quick_start = ROOT.joinpath("README.md").read_text().split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", quick_start, re.S).group(1).strip().splitlines()
    block = [line.split("#", 1)[0].strip() for line in block]  # commands without their comments
    ci = [line for line in ROOT.joinpath(".ci", "run").read_text().splitlines() if line and not line.startswith("#")]
    assert block[-1] == ci[-1] == "hatch test --all"  # the primary suite and the compat tier (hatch.toml)
    assert block[0].startswith("pip install hatch") and "pip install" in ci[-2] and "hatch" in ci[-2]
    # after installing hatch, exactly two commands: train the built-in default, run the tests
    assert block[1:] == ["hatch run mm-train run", "hatch test --all"]


def test_no_pickle_anywhere():
    sources = list(ROOT.glob("packages/*/src/**/*.py")) + list(ROOT.glob("benchmarks/**/*.py"))
    offenders = [str(p) for p in sources if re.search(r"^\s*(import pickle|from pickle|import cloudpickle)",
                                                      p.read_text(), re.M)]
    assert not offenders and sources


def _source_modules():
    """{dotted name: path} of every source module (``__about__`` files aside)."""
    found = {}
    for src in ROOT.glob("packages/*/src"):
        for path in src.rglob("*.py"):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__about__":
                continue
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _test_index():
    """[(module patterns, test files)] of the table in tests/README.md."""
    rows = []
    for line in ROOT.joinpath("tests", "README.md").read_text().splitlines():
        cells = line.split("|")
        if len(cells) == 4 and "`" in cells[1]:
            rows.append((re.findall(r"`([^`]+)`", cells[1]), re.findall(r"`([^`]+)`", cells[2])))
    return rows


def _covers(pattern: str, module: str) -> bool:
    if pattern.endswith(".*"):
        return module == pattern[:-2] or module.startswith(pattern[:-1])
    return module == pattern


def test_every_module_has_its_tests_by_name_or_in_the_index():
    """A test file named after the module in its package's test folder, or a row of tests/README.md
    that names files which exist; no row names a module that is not there."""
    modules, rows = _source_modules(), _test_index()
    tests = {path.stem: path for path in ROOT.glob("tests/**/test_*.py")}
    by_name = {m for m in modules if any(p.stem == f"test_{m.split('.')[-1]}" and
                                         p.relative_to(ROOT / "tests").parts[0] == m.split(".")[0]
                                         for p in ROOT.glob("tests/**/test_*.py"))}
    assert rows and tests
    indexed = {m for m in modules for patterns, _ in rows for p in patterns if _covers(p, m)}
    assert sorted(set(modules) - by_name - indexed) == []
    assert [p for patterns, _ in rows for p in patterns if not any(_covers(p, m) for m in modules)] == []
    assert [f for _, files in rows for f in files if not (ROOT / "tests" / f).is_file()] == []


def _names_a_module(token: str, modules) -> bool:
    """A dotted module name, or a module and one name defined at its top level."""
    parts = token.split(".")
    module = next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in modules), None)
    if module is None:
        return False
    rest = parts[len(module.split(".")):]
    if not rest:
        return True
    defined = rf"^(class |def )?{rest[0]}\b|^{rest[0]} *[:=]|import .*\b{rest[0]}\b"
    return len(rest) == 1 and bool(re.search(defined, modules[module].read_text(), re.M))


def test_the_architecture_document_names_what_exists():
    """Every module, name and file docs/architecture.md puts in backticks is in the repository; in
    its table of layers, a bare name is a module of the row's package."""
    modules = _source_modules()
    text = ROOT.joinpath("docs", "architecture.md").read_text()
    assert "docs/architecture.md" in ROOT.joinpath("README.md").read_text()  # the README links it
    bases = [ROOT, ROOT / "tests", *ROOT.glob("packages/*/src")]
    missing = []
    for line in text.splitlines():
        row = re.match(r"\| (mm-[a-z-]+(?: / -[a-z]+)?) \|", line)
        prefixes = []
        if row:
            first, *others = row.group(1).split(" / ")  # "mm-models-vl / -video": two packages
            stem = first.rsplit("-", 1)[0]
            prefixes = [p.replace("-", "_") for p in [first] + [stem + other for other in others]]
        for token in re.findall(r"`([^`\s]+)`", line):
            bare = token.rstrip("/")
            if re.fullmatch(r"mm_[a-z_]+(\.\w+)*", token):
                ok = _names_a_module(token, modules)
            elif prefixes and re.fullmatch(r"[a-z_0-9]+/?", token):
                ok = any(f"{prefix}.{bare}" in modules for prefix in prefixes)
            elif "/" in token and token.endswith((".py", ".md", ".toml", "/")) and not token.startswith("OUT/") \
                    and "<" not in token:  # a run's output folder, a placeholder
                ok = any((base / bare).exists() for base in bases)
            else:
                continue
            if not ok:
                missing.append(token)
    assert missing == [], missing


def test_the_compat_tier_names_existing_tests():
    """tests/helpers/compat_tier.py (the compat environment's tier): every entry a folder, file or test
    that exists; conftest.py fails a compat session on an entry that collects nothing."""
    from helpers.compat_tier import TIER

    for entry in TIER:
        path, _, name = entry.partition("::")
        assert (ROOT / path).exists(), entry
        if name:
            assert f"def {name}(" in (ROOT / path).read_text(), entry
