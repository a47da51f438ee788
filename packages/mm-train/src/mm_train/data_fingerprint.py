"""The data set's fingerprint, saved with each checkpoint so that a resumed run sees the data it left.

A resumed run continues at the saved data position (epoch, batch) of a shuffle drawn over the
data set's samples; if files were added, removed or edited since, the same position names other
samples and the run would silently train on a different order. The fingerprint records:

- each annotation file (the JSON / JSONL / text lists of samples, a feature cache's index) by its
  sha256 — they are small, and any edit to the sample list changes them;
- the media files (images, videos, feature shards) by path and size — hashing terabytes of video
  at every start is not affordable, and re-encoding or replacing a clip changes its size; the
  list itself is kept when it is short (<= ``LISTED`` files) so a difference can be named.

Paths are stored relative to the first annotation file's folder when under it, so a data set
copied elsewhere with its folder keeps its fingerprint.
"""

from __future__ import annotations

import hashlib
import os
from typing import Dict, List, Optional, Sequence

from mm_train.checkpoint import file_sha256

LISTED = 2000


def _relative(path: str, base: str) -> str:
    path = os.path.abspath(path)
    return os.path.relpath(path, base) if base and path.startswith(base + os.sep) else path


def fingerprint(annotations: Sequence[str], media: Sequence[str]) -> dict:
    """{"annotations": {path: sha256}, "media": {"count", "bytes", "sha256" of the (path, size)
    list, "files": [[path, size], ...] when short}} of the files a data set reads; a missing
    media file has size -1 (the data set counts it as a bad sample)."""
    base = os.path.dirname(os.path.abspath(annotations[0])) if annotations else ""
    listed = sorted({_relative(p, base): (os.path.getsize(p) if os.path.isfile(p) else -1) for p in media}.items())
    digest = hashlib.sha256("\n".join(f"{p}\t{s}" for p, s in listed).encode()).hexdigest()
    out = {"annotations": {_relative(p, base): file_sha256(p) for p in annotations if os.path.isfile(p)},
           "media": {"count": len(listed), "bytes": sum(max(s, 0) for _, s in listed), "sha256": digest}}
    if len(listed) <= LISTED:
        out["media"]["files"] = [list(item) for item in listed]
    return out


def differences(saved: Optional[dict], now: dict) -> List[str]:
    """What changed between two fingerprints, one line each (empty: the same data)."""
    if not saved:
        return []
    lines = []
    before, after = saved.get("annotations", {}), now.get("annotations", {})
    for path in sorted(set(before) | set(after)):
        if path not in after:
            lines.append(f"annotation file {path} is gone")
        elif path not in before:
            lines.append(f"annotation file {path} is new")
        elif before[path] != after[path]:
            lines.append(f"annotation file {path} was edited")
    a, b = saved.get("media", {}), now.get("media", {})
    if a.get("sha256") != b.get("sha256"):
        lines.append(f"media files: {a.get('count')} then ({a.get('bytes')} bytes), {b.get('count')} now "
                     f"({b.get('bytes')} bytes)")
        if "files" in a and "files" in b:
            lines += _named(dict(map(tuple, a["files"])), dict(map(tuple, b["files"])))
    return lines


def _named(before: Dict[str, int], after: Dict[str, int], shown: int = 5) -> List[str]:
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(p for p in set(before) & set(after) if before[p] != after[p])
    lines = []
    for what, paths in (("added", added), ("removed", removed), ("changed size", changed)):
        if paths:
            more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
            lines.append(f"  {what}: {', '.join(paths[:shown])}{more}")
    return lines
