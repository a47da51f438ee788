"""CI runs the README's test command, and nothing pickles."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_test_command():
    quick_start = ROOT.joinpath("README.md").read_text().split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", quick_start, re.S).group(1).strip().splitlines()
    block = [line.split("#", 1)[0].strip() for line in block]  # commands without their comments
    ci = [line for line in ROOT.joinpath(".ci", "run").read_text().splitlines() if line and not line.startswith("#")]
    assert block[-1] == ci[-1] == "hatch test"
    assert block[0].startswith("pip install hatch") and "pip install" in ci[-2] and "hatch" in ci[-2]
    # after installing hatch, exactly two commands: train the built-in default, run the tests
    assert block[1:] == ["hatch run mm-train run", "hatch test"]


def test_no_pickle_anywhere():
    sources = list(ROOT.glob("packages/*/src/**/*.py")) + list(ROOT.glob("benchmarks/**/*.py"))
    offenders = [str(p) for p in sources if re.search(r"^\s*(import pickle|from pickle|import cloudpickle)",
                                                      p.read_text(), re.M)]
    assert not offenders and sources
