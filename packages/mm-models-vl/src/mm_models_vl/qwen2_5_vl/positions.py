"""Qwen2.5-VL positions, computed on the host in numpy (they depend only on token ids and grids).

Everything here follows transformers 5.24 (the pinned version) number for number:

* Vision tower: each patch gets (h, w) grid coordinates laid out block-major over the
  merge x merge blocks; window attention groups the merged tokens into windows of
  ``window_size / patch / merge`` merged tokens a side; full-attention blocks attend within one
  frame (``cu_seqlens``).
* Language model (M-RoPE): text tokens count up on all three axes; an image / video placeholder
  run of t x h x w merged tokens gets (t * interval, h, w) offsets from the position it starts at,
  with interval = tokens_per_second * second_per_grid (1 for images, truncated to an integer
  position); the text after it resumes at start + max(h, w) (5.x; older releases used max + 1).
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence, Tuple

import numpy as np

TEXT, IMAGE, VIDEO = 0, 1, 2


def _grids(grid_thw) -> np.ndarray:
    grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    return grid


def vision_rotary_positions(grid_thw, merge: int) -> np.ndarray:
    """(num_patches, 2) (h, w) coordinates of every patch in the order the processor emits them."""
    out = []
    for t, h, w in _grids(grid_thw):
        if h % merge or w % merge:
            raise ValueError(f"grid {(t, h, w)}: h and w must be multiples of spatial_merge_size={merge}")
        hpos, wpos = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        block = (h // merge, merge, w // merge, merge)
        hpos = hpos.reshape(block).transpose(0, 2, 1, 3).reshape(-1)
        wpos = wpos.reshape(block).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([hpos, wpos], -1), (t, 1)))
    return np.concatenate(out, 0)


def frame_cu_seqlens(grid_thw) -> np.ndarray:
    """Boundaries of the frames (full-attention segments) in the patch sequence."""
    lengths = [h * w for t, h, w in _grids(grid_thw) for _ in range(t)]
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def window_index(grid_thw, merge: int, window_size: int, patch_size: int) -> Tuple[np.ndarray, np.ndarray]:
    """(order of merged tokens grouped by window, window boundaries in patches)."""
    side = window_size // merge // patch_size
    unit = merge * merge
    order, bounds, offset = [], [0], 0
    for t, h, w in _grids(grid_thw):
        gh, gw = h // merge, w // merge
        pad_h, pad_w = side - gh % side, side - gw % side  # as the reference: a full extra window when divisible
        index = np.full((t, gh + pad_h, gw + pad_w), -100, np.int64)
        index[:, :gh, :gw] = np.arange(t * gh * gw).reshape(t, gh, gw)
        nh, nw = (gh + pad_h) // side, (gw + pad_w) // side
        windows = index.reshape(t, nh, side, nw, side).transpose(0, 1, 3, 2, 4).reshape(t, nh * nw, side * side)
        counts = (windows != -100).sum(-1).reshape(-1)
        flat = windows.reshape(-1)
        order.append(flat[flat != -100] + offset)
        bounds.extend((np.cumsum(counts) * unit + bounds[-1]).tolist())
        offset += t * gh * gw
    bounds = np.asarray(bounds, np.int64)
    keep = np.concatenate([[True], np.diff(bounds) != 0])  # unique_consecutive: drop empty windows
    return np.concatenate(order), bounds[keep]


def inverse_frequencies(dim: int, theta: float) -> np.ndarray:
    """1 / theta^(2i / dim), i < dim / 2, in float32 as torch computes it."""
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    return (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)


def vision_cos_sin(positions: np.ndarray, head_dim: int, theta: float) -> Tuple[np.ndarray, np.ndarray]:
    """(num_patches, head_dim) tables of the vision tower's 2-D rotary: [h freqs | w freqs] twice."""
    inv = inverse_frequencies(head_dim // 2, theta)
    freqs = positions[..., None].astype(np.float32) * inv  # (n, 2, head_dim / 4)
    freqs = np.concatenate([freqs[:, 0], freqs[:, 1]], -1)
    freqs = np.concatenate([freqs, freqs], -1)
    return np.cos(freqs), np.sin(freqs)


def mrope_cos_sin(position_ids: np.ndarray, head_dim: int, theta: float,
                  mrope_section: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """(batch, seq, head_dim) M-RoPE tables from (3, batch, seq) positions.

    Frequency band i of mrope_section takes its angle from axis i % 3 (temporal, height, width).
    """
    if sum(mrope_section) != head_dim // 2:
        raise ValueError(f"mrope_section {list(mrope_section)} must sum to head_dim / 2 = {head_dim // 2}")
    inv = inverse_frequencies(head_dim, theta)
    freqs = position_ids[..., None].astype(np.float32) * inv  # (3, b, s, head_dim / 2)
    bounds = np.cumsum([0] + list(mrope_section))
    bands = [freqs[i % 3, :, :, bounds[i]:bounds[i + 1]] for i in range(len(mrope_section))]
    freqs = np.concatenate(bands, -1)
    freqs = np.concatenate([freqs, freqs], -1)
    return np.cos(freqs), np.sin(freqs)


def token_types(input_ids: np.ndarray, image_token_id: int, video_token_id: int) -> np.ndarray:
    """mm_token_type_ids as the processor writes them: 0 text, 1 image placeholder, 2 video placeholder."""
    types = np.zeros_like(input_ids)
    types[input_ids == image_token_id] = IMAGE
    types[input_ids == video_token_id] = VIDEO
    return types


def rope_index(input_ids: np.ndarray, mm_token_type_ids: np.ndarray, image_grid_thw=None, video_grid_thw=None,
               second_per_grid_ts=None, attention_mask: Optional[np.ndarray] = None, *, spatial_merge_size: int,
               tokens_per_second: float) -> Tuple[np.ndarray, np.ndarray]:
    """(3, batch, seq) M-RoPE position ids and the (batch, 1) deltas generation continues from.

    Padding (attention_mask 0) gets position 0 and is skipped when counting; grids and
    second_per_grid_ts are consumed in order across the whole batch.
    """
    batch, seq = input_ids.shape
    positions = np.zeros((3, batch, seq), np.int64)
    grids = {IMAGE: iter(_grids(image_grid_thw)) if image_grid_thw is not None else iter(()),
             VIDEO: iter(_grids(video_grid_thw)) if video_grid_thw is not None else iter(())}
    seconds = iter(np.asarray(second_per_grid_ts, np.float32).reshape(-1)) if second_per_grid_ts is not None \
        else itertools.repeat(np.float32(1.0))
    deltas = []
    for b in range(batch):
        keep = np.ones(seq, bool) if attention_mask is None else np.asarray(attention_mask[b]).astype(bool)
        types = np.asarray(mm_token_type_ids[b])[keep]
        parts, current = [], 0
        start = 0
        for kind, run in itertools.groupby(types.tolist()):
            length = len(list(run))
            if kind == TEXT:
                parts.append(np.broadcast_to(np.arange(length) + current, (3, length)))
                current += length
            else:
                try:
                    t, h, w = next(grids[kind])
                except StopIteration:
                    name = "image_grid_thw" if kind == IMAGE else "video_grid_thw"
                    raise ValueError(f"sample {b} has more {'image' if kind == IMAGE else 'video'} placeholder runs "
                                     f"than rows in {name}") from None
                gh, gw = h // spatial_merge_size, w // spatial_merge_size
                if length != t * gh * gw:
                    raise ValueError(f"sample {b}: a placeholder run of {length} tokens at {start} does not match "
                                     f"grid {(int(t), int(h), int(w))} ({t * gh * gw} merged tokens)")
                interval = np.float32(tokens_per_second) * next(seconds) if kind == VIDEO else np.float32(1.0)
                tpos = (np.arange(t, dtype=np.float32) * interval).astype(np.int64) + current
                grid = np.stack(np.meshgrid(tpos, np.arange(gh) + current, np.arange(gw) + current, indexing="ij"))
                parts.append(grid.reshape(3, -1))
                current += max(gh, gw)
            start += length
        row = np.concatenate(parts, 1) if parts else np.zeros((3, 0), np.int64)
        positions[:, b, keep] = row
        deltas.append((row.max() + 1 if row.size else 0) - int(keep.sum()))
    return positions, np.asarray(deltas, np.int64)[:, None]
