"""Attention segment lengths of the Qwen2.5-VL vision tower (for its FLOPs), from the grids alone."""

from __future__ import annotations

from typing import List, Tuple

import numpy as np


def _cuts(length: int, side: int) -> List[int]:
    """A run of ``length`` merged tokens cut into windows of ``side``: full ones, then the rest."""
    return [side] * (length // side) + ([length % side] if length % side else [])


def segment_lengths(grids: np.ndarray, merge: int, window_size: int, patch_size: int) -> Tuple[List[int], List[int]]:
    """(window lengths, frame lengths) in patches over every frame of every grid (t, h, w)."""
    side = window_size // merge // patch_size
    windows, frames = [], []
    for t, h, w in np.asarray(grids, np.int64).reshape(-1, 3):
        per_frame = [a * b * merge * merge for a in _cuts(h // merge, side) for b in _cuts(w // merge, side)]
        windows += per_frame * int(t)
        frames += [int(h * w)] * int(t)
    return windows, frames
