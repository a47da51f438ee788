"""The tested-versions table: one warning line at start outside it (never a refusal), the packages'
ranges admitting every tested release and stopping before the next, each README's table naming them."""

import pathlib
import re

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from mm_train import tested_versions
from mm_train.tested_versions import TESTED, untested, warn_untested

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPENDS = {"mindspore": ("mm-parallel", "mm-profiling"),
           "transformers": ("mm-data", "mm-models-vl", "mm-models-video")}
READMES = {"mindspore": ("mm-parallel", "mm-profiling", "mm-train"),
           "transformers": ("mm-data", "mm-models-vl", "mm-models-video", "mm-train")}


def test_a_tested_release_is_silent_and_an_untested_one_is_named_in_one_line(capsys):
    assert untested({"mindspore": "2.10.0", "transformers": "5.24.0", "numpy": "1.26.4"}) == []
    assert not warn_untested({"mindspore": "2.7.2"})
    assert warn_untested({"mindspore": "2.11.0", "transformers": "5.26.1"})
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["mm-train: untested versions: MindSpore 2.11.0 (tested: 2.7.2, 2.8.0, 2.9.0, 2.10.0); "
                     "transformers 5.26.1 (tested: 5.24.0, 5.25.0). The run goes on; if it fails, retry on a "
                     "tested release before reporting it"]


def test_the_launcher_says_it_once_and_its_workers_do_not(monkeypatch, capsys):
    from mm_train import cli
    from mm_train.recipe import load_recipe

    installed = tested_versions.installed()
    monkeypatch.setitem(TESTED, "mindspore", ("9.9.9",))
    recipe = load_recipe(None, [])
    cli.settle_runtime(recipe, in_launch=True)
    assert "untested" not in capsys.readouterr().err
    cli.settle_runtime(recipe, in_launch=False)
    said = [line for line in capsys.readouterr().err.splitlines() if "untested" in line]
    assert said == [f"mm-train: untested versions: MindSpore {installed['mindspore']} (tested: 9.9.9). The run "
                    f"goes on; if it fails, retry on a tested release before reporting it"]


def _requirement(package: str, name: str) -> Requirement:
    text = (ROOT / "packages" / package / "pyproject.toml").read_text()
    found = [Requirement(m) for m in re.findall(r'"([^"]+)"', text) if re.match(rf"{name}\s*[<>=]", m)]
    assert len(found) == 1, (package, name, found)
    return found[0]


@pytest.mark.parametrize("name", sorted(DEPENDS))
def test_each_range_admits_every_tested_release_and_not_the_next_minor(name):
    newest = Version(TESTED[name][-1])
    next_minor = f"{newest.major}.{newest.minor + 1}.0"
    for package in DEPENDS[name]:
        spec = _requirement(package, name).specifier
        assert all(spec.contains(v) for v in TESTED[name]), (package, spec)
        assert not spec.contains(next_minor), (package, spec)


@pytest.mark.parametrize("name", sorted(READMES))
def test_each_readme_table_names_every_tested_release(name):
    for package in READMES[name]:
        text = (ROOT / "packages" / package / "README.md").read_text()
        assert "## Tested versions" in text, package
        table = text.split("## Tested versions", 1)[1].split("\n## ", 1)[0]
        for version in TESTED[name]:
            assert re.search(rf"\|\s*{re.escape(version)}\s*\|", table), (package, name, version)
