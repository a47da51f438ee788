"""Choosing the next token from a row of logits: greedy, or sampled after temperature, top-k and top-p.

With logits z over the vocabulary, sampling draws from softmax(z') where z' is z after, in
transformers' order (GenerationMixin._get_logits_processor):

    temperature T   z' = z / T
    top-k k         z'_v = -inf where z'_v < the k-th largest z'   (ties at the k-th kept)
    top-p p         sort ascending, c = cumsum(softmax); z'_v = -inf where c_v <= 1 - p,
                    the largest always kept                          (nucleus sampling)

Greedy is argmax z (the first index of a tie, as torch's argmax).

The draw is inverse-CDF: u ~ U[0, 1) per row and step, token = the first v whose cumulative
probability exceeds u. Each row's uniforms come from its own seeded stream (`row_uniforms`:
numpy's PCG64 seeded with (seed, key, ...)), so a completion depends only on its key (the
prompt's number in the run, its copy) and the logits — not on the batch it was decoded in, the
data-parallel rank or the layout — and a resumed run draws what the uninterrupted one drew
without saving any generator state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Sampling:
    """How a token is chosen (transformers' GenerationConfig names): ``do_sample`` False is greedy."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off

    def __post_init__(self):
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {self.temperature}; for greedy decoding "
                             "set do_sample false")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: off), got {self.top_p}")

    def filtered_logits(self, logits: np.ndarray) -> np.ndarray:
        """(rows, vocab) float64 logits after temperature, top-k and top-p (module docstring)."""
        z = np.asarray(logits, np.float64) / self.temperature
        if self.top_k and self.top_k < z.shape[-1]:
            kth = np.partition(z, -self.top_k, -1)[:, -self.top_k][:, None]
            z = np.where(z < kth, -np.inf, z)
        if self.top_p < 1:
            order = np.argsort(z, -1, kind="stable")
            ascending = np.take_along_axis(z, order, -1)
            probs = np.exp(ascending - ascending[:, -1:])
            cumulative = np.cumsum(probs / probs.sum(-1, keepdims=True), -1)
            drop = cumulative <= 1 - self.top_p
            drop[:, -1] = False
            removed = np.zeros_like(drop)
            np.put_along_axis(removed, order, drop, -1)
            z = np.where(removed, -np.inf, z)
        return z

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """(rows, vocab) float64 probabilities a sampled token is drawn from."""
        z = self.filtered_logits(logits)
        p = np.exp(z - z.max(-1, keepdims=True))
        return p / p.sum(-1, keepdims=True)

    def pick(self, logits: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
        """(rows,) int64 next tokens of (rows, vocab) logits; ``uniforms`` (rows,) in [0, 1) (sampling only)."""
        logits = np.asarray(logits)
        if not self.do_sample:
            return logits.argmax(-1).astype(np.int64)
        cumulative = np.cumsum(self.probabilities(logits), -1)
        tokens = (cumulative <= np.asarray(uniforms, np.float64)[:, None] * cumulative[:, -1:]).sum(-1)
        return np.minimum(tokens, logits.shape[-1] - 1).astype(np.int64)


def row_uniforms(seed: int, keys: Sequence[Sequence[int]], steps: int) -> np.ndarray:
    """(rows, steps) uniforms in [0, 1): row i's from the stream seeded with (seed, *keys[i])."""
    out = np.empty((len(keys), steps), np.float64)
    for row, key in enumerate(keys):
        out[row] = np.random.default_rng([int(seed), *map(int, key)]).random(steps)
    return out
