"""Sequences that share their prompt's media, kept in one micro-batch: a preference pair's two
answers (`mm_data.vl.pairs`), GRPO's G completions of one prompt.

A micro-batch of P groups of n sequences holds the n P sequences copy-major — every group's first
sequence, then every group's second, ... — as padded rows or the segments of one packed row
alike. The towers' inputs (pixels, audio features) come once, with the first copies; every other
media field (grids, seconds per grid, audio masks: one entry per placeholder run) comes with each
sequence, so each later copy repeats the first copies' list. ``media_copies = n`` tells the model
(its forward keyword) that the placeholders hold the features n times over: the towers run once
per group and each sequence reads the same features (mm_models_vl's ``place_rows``).
"""

from __future__ import annotations

from typing import Callable, Dict, List

from mm_data.vl.packing import pack

TOWER_INPUTS = ("pixel_values", "pixel_values_videos", "input_features")  # given once per group


def copy_major(groups: List[List[Dict]]) -> List[Dict]:
    """The groups' sequences copy-major, the towers' inputs only on the first copies (module docstring)."""
    sizes = {len(group) for group in groups}
    if len(sizes) != 1:
        raise ValueError(f"the groups of a micro-batch must hold as many sequences each, got sizes {sorted(sizes)}")
    copies = sizes.pop()
    return [group[c] if c == 0 else {k: v for k, v in group[c].items() if k not in TOWER_INPUTS}
            for c in range(copies) for group in groups]


def collate_groups(collate: Callable, groups: List[List[Dict]], pack_rows: bool = False) -> Dict:
    """The groups' sequences (`copy_major`) ``collate``d — one packed row with ``pack_rows``, else
    padded rows — with ``media_copies``."""
    sequences = copy_major(groups)
    batch = collate([pack(sequences)] if pack_rows else sequences)
    batch["media_copies"] = len(groups[0])
    return batch
