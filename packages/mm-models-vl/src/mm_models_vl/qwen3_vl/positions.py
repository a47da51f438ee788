"""Qwen3-VL positions, on the host in numpy; what differs from Qwen2.5-VL's (which are reused).

Everything follows transformers 5.24 number for number:

* Learned vision positions: the square table of ``num_position_embeddings`` = side^2 rows is
  resampled to each grid bilinearly with aligned corners (torch's F.interpolate(align_corners=
  True)): patch (r, c) of an h x w grid reads src = (r (side - 1) / max(h - 1, 1), c (...)) and
  mixes its 4 neighbours (clamped to the table) with the tent weights prod(1 - |src - tap|).
  Patches come in the processor's block-major order (Qwen2.5-VL's `vision_rotary_positions`).
* Vision attention is per frame everywhere (no windows); the 2-D rotary is Qwen2.5-VL's.
* Interleaved M-RoPE: frequency j of head_dim / 2 takes its angle from the height axis when
  j = 1 mod 3 and j < 3 mrope_section[1], from the width axis when j = 2 mod 3 and
  j < 3 mrope_section[2], else from the temporal axis (the sections index strided slots, not
  contiguous bands as in Qwen2.5-VL).
* Text positions: Qwen2.5-VL's rule with every temporal patch of a video its own placeholder run
  (the chat template writes ``<t seconds><vision_start>pads<vision_end>`` per temporal patch), so
  a video grid (t, h, w) is t grids (1, h, w) and time lives in the timestamp text, not in the
  temporal position.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np

from mm_models_vl.qwen2_5_vl import positions as qwen2_5

token_types = qwen2_5.token_types
vision_rotary_positions = qwen2_5.vision_rotary_positions
vision_cos_sin = qwen2_5.vision_cos_sin
frame_cu_seqlens = qwen2_5.frame_cu_seqlens


def _axis_taps(index: np.ndarray, size: np.ndarray, side: int) -> Tuple[np.ndarray, np.ndarray]:
    """(n, 2) clamped table rows and tent weights of positions ``index`` on axes of ``size``."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.maximum(size - 1, 1).astype(np.float32)
    floor = np.floor(src)
    offsets = np.arange(2, dtype=np.float32)
    taps = np.clip(floor[:, None].astype(np.int64) + np.arange(2), 0, side - 1)
    weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - offsets), 0, None).astype(np.float32)
    return taps, weights


def position_embedding_taps(grid_thw, num_position_embeddings: int, merge: int) -> Tuple[np.ndarray, np.ndarray]:
    """(num_patches, 4) rows of the learned table and their bilinear weights (module docstring)."""
    side = int(num_position_embeddings ** 0.5)
    if side * side != num_position_embeddings:
        raise ValueError(f"num_position_embeddings={num_position_embeddings} must be a square (a side x side grid)")
    grids = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    coords = vision_rotary_positions(grids, merge)  # (n, 2) block-major (h, w)
    counts = grids.prod(1)
    heights, widths = np.repeat(grids[:, 1], counts), np.repeat(grids[:, 2], counts)
    rows, row_w = _axis_taps(coords[:, 0], heights, side)
    cols, col_w = _axis_taps(coords[:, 1], widths, side)
    index = (rows[:, :, None] * side + cols[:, None, :]).reshape(-1, 4)
    weights = (row_w[:, :, None] * col_w[:, None, :]).reshape(-1, 4)
    return index, weights


def interleaved_mrope_cos_sin(position_ids: np.ndarray, head_dim: int, theta: float,
                              mrope_section: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """(batch, seq, head_dim) tables from (3, batch, seq) positions, axes interleaved (module docstring)."""
    half = head_dim // 2
    if len(mrope_section) != 3 or sum(mrope_section) != half:
        raise ValueError(f"mrope_section {list(mrope_section)} must be three numbers summing to head_dim / 2 = "
                         f"{half}")
    freqs = position_ids[..., None].astype(np.float32) * qwen2_5.inverse_frequencies(head_dim, theta)
    mixed = freqs[0].copy()
    for axis in (1, 2):
        slots = slice(axis, 3 * mrope_section[axis], 3)
        mixed[..., slots] = freqs[axis, ..., slots]
    mixed = np.concatenate([mixed, mixed], -1)
    return np.cos(mixed), np.sin(mixed)


def per_frame_grids(video_grid_thw) -> Optional[np.ndarray]:
    """Each video grid (t, h, w) as t grids (1, h, w): one per timestamped placeholder run."""
    if video_grid_thw is None:
        return None
    grids = np.asarray(video_grid_thw, np.int64).reshape(-1, 3)
    frames = np.repeat(grids, grids[:, 0], axis=0)
    frames[:, 0] = 1
    return frames


def rope_index(input_ids: np.ndarray, mm_token_type_ids: np.ndarray, image_grid_thw=None, video_grid_thw=None,
               attention_mask: Optional[np.ndarray] = None, *, spatial_merge_size: int) \
        -> Tuple[np.ndarray, np.ndarray]:
    """(3, batch, seq) M-RoPE positions and (batch, 1) deltas, as transformers' Qwen3-VL get_rope_index."""
    return qwen2_5.rope_index(input_ids, mm_token_type_ids, image_grid_thw, per_frame_grids(video_grid_thw),
                              None, attention_mask, spatial_merge_size=spatial_merge_size, tokens_per_second=1.0)
