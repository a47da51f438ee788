"""The parity references the twins are tested against (hatch.toml installs them); tests/conftest.py
stops a session without them. transformers may be any tested release (mm_train.tested_versions:
the primary environment has the first, the compat one the last)."""

from importlib import metadata

from mm_train.tested_versions import TESTED

REFERENCES = {"torch": ("2.13.0",), "transformers": TESTED["transformers"], "diffusers": ("0.42.1",)}


def reference_problems(installed=None) -> list:
    """What is wrong with the installed parity references (empty: all there, at tested versions)."""
    problems = []
    for name, wanted in REFERENCES.items():
        try:
            version = (installed[name] if installed is not None else metadata.version(name)).split("+")[0]  # 2.13.0+cpu
        except (KeyError, metadata.PackageNotFoundError):
            problems.append(f"{name} is not installed")
            continue
        if version not in wanted:
            problems.append(f"{name} {version} is installed; the tests compare against {' or '.join(wanted)}")
    return problems
