"""Preference pairs of clips for Diffusion-DPO: a prompt with a preferred and a rejected clip.

Annotations: a JSON list or JSON lines of ``{"prompt": ..., "chosen": "a.mp4", "rejected":
"b.mp4"}`` (``cap`` / ``caption`` / ``text`` name the prompt too), paths relative to the file's
folder. A pair missing a side, a side whose file is not there, or the same clip on both sides is
a `BadSample`: counted and logged, never half used. `pair_records` lays a pair's clips out as
two video records with the prompt as their caption, so the feature cache encodes both like any
clip; `write_pair_list` records the pairs in the cache folder (``pairs.json``), and
`mm_data.feature_cache.FeaturePairs` serves them from the cache as one sample each — the chosen clip's features, the
rejected one's under ``rejected_<name>`` (the prompt's embedding once) — so a sampler, the
data-parallel split and the micro-batches never part a pair. A pair whose clips landed in
different buckets (other feature shapes) cannot share a noise draw and is skipped, counted.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import List, Optional

from mm_data.entries import json_entries, parse_all
from mm_data.errors import BadInputLog, BadSample
from mm_data.video.annotations import VideoRecord

PAIR_LIST = "pairs.json"


@dataclass(frozen=True)
class ClipPair:
    prompt: str
    chosen: str  # the clips' paths
    rejected: str


def _pair(entry, folder: str, source: str) -> ClipPair:
    if not isinstance(entry, dict):
        raise BadSample(source, f"expected an object, got {type(entry).__name__}")
    prompt = next((entry[k] for k in ("prompt", "cap", "caption", "text") if isinstance(entry.get(k), str)), "")
    if not prompt.strip():
        raise BadSample(source, "no prompt ('prompt', 'cap', 'caption' or 'text')")
    sides = {}
    for side in ("chosen", "rejected"):
        path = entry.get(side)
        if not isinstance(path, str) or not path:
            raise BadSample(source, f"'{side}' is missing: a pair needs a chosen and a rejected clip")
        sides[side] = os.path.join(folder, path)
        if not os.path.isfile(sides[side]):
            raise BadSample(sides[side], f"the {side} clip's file is not there")
    if os.path.abspath(sides["chosen"]) == os.path.abspath(sides["rejected"]):
        raise BadSample(source, "the chosen and the rejected clip are the same file: the pair teaches nothing")
    return ClipPair(prompt, sides["chosen"], sides["rejected"])


def read_clip_pairs(path: str, log: Optional[BadInputLog] = None, folder: Optional[str] = None) -> List[ClipPair]:
    """The pairs of a JSON / JSONL file (module docstring)."""
    log = log if log is not None else BadInputLog()
    folder = os.path.dirname(os.path.abspath(path)) if folder is None else folder
    pairs = parse_all(json_entries(path, log), lambda entry, source: _pair(entry, folder, source), log)
    log.total = len(pairs) + log.count
    log.check()
    return pairs


def pair_records(pairs: List[ClipPair]) -> List[VideoRecord]:
    """Each pair's clips as video records captioned with its prompt: chosen, rejected, chosen, ..."""
    return [VideoRecord(path, (pair.prompt,)) for pair in pairs for path in (pair.chosen, pair.rejected)]


def write_pair_list(folder: str, pairs: List[ClipPair]) -> None:
    """The pairs a feature cache was built from (``pairs.json``), written atomically."""
    os.makedirs(folder, exist_ok=True)
    temporary = os.path.join(folder, PAIR_LIST + ".tmp")
    with open(temporary, "w") as f:
        json.dump([{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected} for p in pairs], f, indent=1)
    os.replace(temporary, os.path.join(folder, PAIR_LIST))
