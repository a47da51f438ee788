"""benchmarks/recipe_figures.py: every figure it measures is still quoted in its README, it reads a
run's losses and time, and --write replaces exactly the quoted figure."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_every_figure_is_quoted_in_its_readme():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "recipe_figures.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "4 figures found" in result.stdout, result.stderr[-2000:]


def test_a_measured_figure_is_written_in_place(tmp_path):
    import recipe_figures

    figure = recipe_figures.FIGURES[0]
    got = recipe_figures.measure(recipe_figures.Figure(figure.readme, figure.before, figure.recipe, 2), tmp_path)
    assert float(got["first"]) > float(got["last"]) > 0 and float(got["seconds"]) > 0
    readme = tmp_path / "README.md"
    original = (ROOT / figure.readme).read_text()
    readme.write_text(original)
    copy = recipe_figures.Figure(str(readme), figure.before, figure.recipe, figure.steps)
    recipe_figures.write(copy, {"first": "9.99", "last": "0.01", "seconds": "7"})
    written = readme.read_text()
    assert f"loss 9.99 -> 0.01 in {figure.steps} steps, 7 s" in written
    assert len(written.splitlines()) == len(original.splitlines())
    old = copy.pattern().search(original)
    assert written[:old.start()] == original[:old.start()]
