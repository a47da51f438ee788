"""The releases of MindSpore and transformers mm is tested on, and the one line a run prints when it
starts on another.

The table is what the test environments ran (hatch.toml): `primary` runs the whole suite on the
first release of each row, `compat` the compat tier (tests/helpers/compat_tier.py) on the last; the
releases between went through the compat tier by hand when they were added (docs/versions.md
has what differs between them). The packages' dependency ranges admit every release here and stop
before the next minor one; an untested release is met as a patch release inside them or one
installed past them (`pip install --no-deps`, a prebuilt image): it is named, never refused.
"""

import sys
from importlib import metadata
from typing import Dict, List, Mapping, Optional, TextIO

TESTED: Dict[str, tuple] = {
    "mindspore": ("2.7.2", "2.8.0", "2.9.0", "2.10.0"),
    "transformers": ("5.24.0", "5.25.0"),
}
DISPLAY = {"mindspore": "MindSpore", "transformers": "transformers"}


def installed(names=tuple(TESTED)) -> Dict[str, str]:
    """The installed release of each name (local tags dropped: 2.13.0+cpu is 2.13.0); absent ones left out."""
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name).split("+")[0]
        except metadata.PackageNotFoundError:
            continue
    return found


def untested(versions: Mapping[str, str]) -> List[str]:
    """'NAME VERSION (tested: A, B, ...)' for each installed release outside the table."""
    return [f"{DISPLAY[name]} {version} (tested: {', '.join(TESTED[name])})"
            for name, version in versions.items() if name in TESTED and version not in TESTED[name]]


def warn_untested(versions: Optional[Mapping[str, str]] = None, stream: Optional[TextIO] = None) -> bool:
    """Print one line naming the untested releases and what is tested; True when it printed."""
    outside = untested(installed() if versions is None else versions)
    if outside:
        print(f"mm-train: untested versions: {'; '.join(outside)}. The run goes on; if it fails, retry on a "
              f"tested release before reporting it", file=stream or sys.stderr)
    return bool(outside)
