"""Data-parallel balance: a global batch's samples given to the ranks so that each does as much work.

    balance(costs, ranks, groups=None) -> [[the sample indices of rank 0], [... of rank 1], ...]

``costs[i]`` is what sample i costs, one number per kind — tokens, vision patches, audio frames:
every kind is balanced at once. The units placed are ``groups`` (samples that must stay on one
rank: the two answers of a preference pair, the completions of one prompt), or single samples.

Longest processing time first (Graham, 1969): the units by descending cost, each to the rank
whose heaviest kind would be lightest after taking it, each kind measured as a share of the
batch's total of that kind (so tokens and patches compare); ties go to the rank with fewer
samples, then the lower rank. For one kind the heaviest rank is within 4/3 - 1/(3 ranks) of the
best possible; a pure function of its inputs, so every rank computes the same assignment. Each
rank's samples keep their order in the batch.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import numpy as np

Cost = Union[float, Sequence[float]]


def _cost_matrix(costs: Sequence[Cost]) -> np.ndarray:
    matrix = np.asarray([c if np.ndim(c) else [c] for c in costs], dtype=np.float64)
    if matrix.ndim != 2 or (matrix < 0).any() or not np.isfinite(matrix).all():
        raise ValueError("costs must be one finite number >= 0 per sample, or one sequence of them of the same "
                         "length per sample (tokens, patches, ...)")
    return matrix


def _units(count: int, groups: Optional[Sequence[Sequence[int]]]) -> List[List[int]]:
    if groups is None:
        return [[i] for i in range(count)]
    units = [sorted(int(i) for i in group) for group in groups]
    placed = sorted(i for unit in units for i in unit)
    if placed != list(range(count)) or any(not unit for unit in units):
        raise ValueError(f"groups must hold every sample index 0..{count - 1} exactly once, in non-empty groups")
    return units


def balance(costs: Sequence[Cost], ranks: int, groups: Optional[Sequence[Sequence[int]]] = None) -> List[List[int]]:
    """The samples of each rank (module docstring)."""
    matrix = _cost_matrix(costs)
    units = _units(len(matrix), groups)
    if ranks < 1 or len(units) < ranks:
        raise ValueError(f"{len(units)} samples (or groups) cannot give each of {ranks} ranks one: make the global "
                         "batch at least as large as the data-parallel size")
    totals = matrix.sum(0)
    shares = matrix / np.where(totals > 0, totals, 1.0)
    unit_shares = np.array([shares[unit].sum(0) for unit in units])
    loads = np.zeros((ranks, matrix.shape[1]))
    counts = [0] * ranks
    assigned: List[List[int]] = [[] for _ in range(ranks)]
    order = sorted(range(len(units)), key=lambda u: (-unit_shares[u].max(), -unit_shares[u].sum(), u))
    for u in order:
        worst = (loads + unit_shares[u]).max(1)
        rank = min(range(ranks), key=lambda r: (worst[r], counts[r], r))
        loads[rank] += unit_shares[u]
        counts[rank] += len(units[u])
        assigned[rank] += units[u]
    return [sorted(samples) for samples in assigned]


def rank_loads(costs: Sequence[Cost], assignment: Sequence[Sequence[int]]) -> np.ndarray:
    """(ranks, kinds): each rank's summed cost of each kind."""
    matrix = _cost_matrix(costs)
    return np.array([matrix[list(samples)].sum(0) if samples else np.zeros(matrix.shape[1])
                     for samples in assignment])


def max_over_mean(costs: Sequence[Cost], assignment: Sequence[Sequence[int]]) -> List[float]:
    """Per kind, the heaviest rank's load over the mean rank's (1.0 is perfect balance)."""
    loads = rank_loads(costs, assignment)
    mean = loads.mean(0)
    return [float(top / avg) if avg > 0 else 1.0 for top, avg in zip(loads.max(0), mean)]
