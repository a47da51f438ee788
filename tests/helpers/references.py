"""The parity references the twins are tested against (hatch.toml installs them); tests/conftest.py
stops a session without them."""

from importlib import metadata

REFERENCES = {"torch": "2.13.0", "transformers": "5.24.", "diffusers": "0.42.1"}  # exact, or a prefix ending in "."


def reference_problems(installed=None) -> list:
    """What is wrong with the installed parity references (empty: all there, at the tested versions)."""
    problems = []
    for name, wanted in REFERENCES.items():
        try:
            version = (installed[name] if installed is not None else metadata.version(name)).split("+")[0]  # 2.13.0+cpu
        except (KeyError, metadata.PackageNotFoundError):
            problems.append(f"{name} is not installed")
            continue
        if not (version.startswith(wanted) if wanted.endswith(".") else version == wanted):
            problems.append(f"{name} {version} is installed; the tests compare against {wanted.rstrip('.')}")
    return problems
