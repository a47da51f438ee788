"""Packed rows: several samples in one row of a micro-batch, kept apart (host side, numpy).

A packed row is a batch of one whose ``attention_mask`` holds each token's sample number
(1, 1, 1, 2, 2, ...; 0 is padding), as LLaMA-Factory's neat_packing and `mm_data.vl.pack` write
it. The VL models then, for every sample of the row,
  attend only inside it (segment ids; causal inside),
  give it the M-RoPE / TMRoPE positions transformers computes for that sample alone,
  drop the target that would cross from its last token into the next sample's first,
so the row's summed loss and gradients equal those of its samples run one by one.

The loss divides by ``num_items_in_batch`` when given (transformers' keyword: the answer tokens
of the whole global batch, so a run packed or not, on any layout, takes the same per-token
mean); with ``loss_per_sample`` each sample's tokens are first weighted by one over its own count
(the mean of per-sample means; ``num_items_in_batch`` then counts samples).
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import numpy as np


def row_segments(attention_mask) -> Optional[np.ndarray]:
    """(1, seq) sample numbers of a packed row, or None for a 0 / 1 mask (an unpacked batch)."""
    if attention_mask is None:
        return None
    mask = np.asarray(attention_mask)
    if mask.size == 0 or mask.max() <= 1:
        return None
    if mask.shape[0] != 1:
        raise ValueError(f"packed rows (attention_mask holding sample numbers) come one per micro-batch; got a "
                         f"batch of {mask.shape[0]}: set the micro-batch to one row")
    numbers = mask[0].astype(np.int64)
    real = numbers[numbers > 0]
    starts = real[np.r_[True, real[1:] != real[:-1]]]
    if np.any(np.diff(starts) <= 0):
        raise ValueError("a packed row's attention_mask must number its samples 1, 2, 3 ... in order, each sample's "
                         "tokens together")
    return numbers[None]


def per_sample_positions(positions_of: Callable, segments: np.ndarray) -> np.ndarray:
    """(3, 1, seq) positions of a packed row: ``positions_of(mask)`` — the family's position
    function on a (K, seq) batch whose row k keeps only sample k's tokens (mask 1 there, 0
    elsewhere) — computes each sample alone, its media taken in order; padding gets 0."""
    ids = segments[0]
    count = int(ids.max())
    masks = (ids[None, :] == np.arange(1, count + 1)[:, None]).astype(np.int64)
    positions = np.asarray(positions_of(masks))  # (3, K, seq)
    row = np.zeros((positions.shape[0], 1, ids.size), np.int64)
    for k in range(count):
        keep = masks[k].astype(bool)
        row[:, 0, keep] = positions[:, k, keep]
    return row


def cut_at_boundaries(targets: np.ndarray, segments: np.ndarray) -> np.ndarray:
    """Next-token ``targets`` (batch 1) with -100 where the next token belongs to another sample."""
    crossing = np.zeros_like(targets, bool)
    crossing[:, :-1] = segments[:, :-1] != segments[:, 1:]
    return np.where(crossing, -100, targets)


def sequence_numbers(targets: np.ndarray, segments: Optional[np.ndarray]) -> Tuple[np.ndarray, int]:
    """(each target's sequence: a packed row's samples 0, 1, ... in order, or an unpacked batch's
    rows; -1 where nothing is counted; the number of sequences): whose log-probabilities a target
    adds to (mm_parallel.preference.sequence_log_probs)."""
    if segments is not None:
        numbers, count = segments.astype(np.int64) - 1, int(segments.max())
    else:
        numbers, count = np.broadcast_to(np.arange(len(targets))[:, None], targets.shape), len(targets)
    return np.where(targets != -100, numbers, -1), count


def sample_weights(targets: np.ndarray, samples: np.ndarray) -> Tuple[np.ndarray, int]:
    """(float32 weight per target: one over the counted targets of its sample, 0 where not
    counted; the number of samples with a counted target). ``samples``: each position's sample
    (a packed row's segments, or the row number of an unpacked batch)."""
    counted = targets != -100
    keys = samples[counted]
    numbers, counts = np.unique(keys, return_counts=True)
    weights = np.zeros(targets.shape, np.float32)
    if numbers.size:
        weights[counted] = 1.0 / counts[np.searchsorted(numbers, keys)]
    return weights, int(numbers.size)
