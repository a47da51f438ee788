"""Where each routed token goes: pure numpy functions of the router's choices (unit-tested).

A rank routes T tokens to k experts each: T k slots (t, j) with expert e[t, j] and weight w[t, j].

Capacity (Megatron's drop): an expert takes at most C = ceil(capacity_factor T k / E) of the
rank's slots; "probs" keeps its C largest weights, "position" its C earliest tokens (row-major
slot order); the rest are dropped (weight zero, not sent).

Send layout (all-to-all): the kept slots sorted by expert (stable, so by token inside an expert).
Experts are laid out contiguously over the ep ranks (rank p holds [p E/P, (p+1) E/P)), so this
order is also by destination rank: rank p's rows are one contiguous piece. With
pad_to_capacity every expert gets exactly C rows (-1: a padding row, zeros).

Expert groups: the rows an expert stack computes, grouped by local expert and padded to the
largest group M (at least one), so E_local experts run as one batched matmul (E_local, M, H):
``padded[e M + i]`` is the buffer row of expert e's i-th row (``sink``: a zero row, padding)
and ``slot[r]`` the padded position of buffer row r.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np


def capacity(tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """ceil(factor * tokens * top_k / num_experts): the slots one expert takes from a rank."""
    return max(1, math.ceil(factor * tokens * top_k / num_experts))


def capacity_keep(experts: np.ndarray, weights: np.ndarray, num_experts: int, cap: int,
                  policy: str = "probs") -> np.ndarray:
    """(T, k) bool: the slots each expert keeps within its capacity ``cap``."""
    flat_e, flat_w = experts.reshape(-1), weights.reshape(-1)
    keep = np.zeros(flat_e.size, bool)
    for e in np.unique(flat_e):
        slots = np.flatnonzero(flat_e == e)
        if policy == "probs":  # largest weights first; ties by position (stable)
            slots = slots[np.argsort(-flat_w[slots], kind="stable")]
        keep[slots[:cap]] = True
    return keep.reshape(experts.shape)


@dataclass
class SendLayout:
    """The rows a rank sends, in expert order: ``tokens[r]`` the token of row r (-1: padding),
    ``experts[r]`` its expert, ``counts[e]`` the rows for expert e, ``row_of_slot[t, j]`` the row of
    slot (t, j) (-1: dropped)."""

    tokens: np.ndarray
    experts: np.ndarray
    counts: np.ndarray
    row_of_slot: np.ndarray


def send_layout(experts: np.ndarray, keep: Optional[np.ndarray], num_experts: int,
                pad_to: Optional[int] = None) -> SendLayout:
    """The kept slots sorted by expert (see the module docstring); ``pad_to``: rows per expert."""
    T, k = experts.shape
    flat = experts.reshape(-1)
    kept = np.arange(flat.size) if keep is None else np.flatnonzero(keep.reshape(-1))
    order = kept[np.argsort(flat[kept], kind="stable")]
    counts = np.bincount(flat[order], minlength=num_experts)
    row_of_slot = np.full(flat.size, -1, np.int64)
    if pad_to is None:
        row_of_slot[order] = np.arange(order.size)
        return SendLayout(order // k, flat[order], counts, row_of_slot.reshape(T, k))
    if counts.max(initial=0) > pad_to:
        raise ValueError(f"an expert has {counts.max()} rows, more than its capacity {pad_to}")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank_in_expert = np.arange(order.size) - starts[flat[order]]
    rows = flat[order] * pad_to + rank_in_expert
    tokens = np.full(num_experts * pad_to, -1, np.int64)
    tokens[rows] = order // k
    row_of_slot[order] = rows
    return SendLayout(tokens, np.repeat(np.arange(num_experts), pad_to), np.full(num_experts, pad_to),
                      row_of_slot.reshape(T, k))


def received_experts(count_matrix: np.ndarray, rank: int, local: int) -> np.ndarray:
    """The local expert of each row a rank receives: from every source q in turn, its rows for
    this rank's experts in expert order. ``count_matrix[q, e]``: rows q sends to expert e."""
    mine = count_matrix[:, rank * local:(rank + 1) * local]
    return np.concatenate([np.repeat(np.arange(local), row) for row in mine]).astype(np.int64)


@dataclass
class ExpertGroups:
    """See the module docstring: ``padded`` (E_local M,), ``slot`` (rows,), ``counts`` (E_local,), ``width`` M."""

    padded: np.ndarray
    slot: np.ndarray
    counts: np.ndarray
    width: int


def expert_groups(expert_of_row: np.ndarray, local: int, sink: int) -> ExpertGroups:
    """Group buffer rows by local expert (stable), padded to the largest group; -1 rows are skipped."""
    rows = np.flatnonzero(expert_of_row >= 0)
    rows = rows[np.argsort(expert_of_row[rows], kind="stable")]
    counts = np.bincount(expert_of_row[rows], minlength=local)
    width = max(1, int(counts.max(initial=0)))
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    position = expert_of_row[rows] * width + (np.arange(rows.size) - starts[expert_of_row[rows]])
    padded = np.full(local * width, sink, np.int64)
    padded[position] = rows
    slot = np.full(expert_of_row.size, local * width, np.int64)  # unrouted rows -> the zero row after the groups
    slot[rows] = position
    return ExpertGroups(padded, slot, counts, width)
