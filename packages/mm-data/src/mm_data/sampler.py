"""Deterministic, resumable, data-parallel-aware batches, grouped by shape bucket or length.

A *global batch* is ``global_batch_size`` sample indices; data-parallel rank ``r`` of ``dp`` takes
the ``r``-th contiguous share. The global batches of an epoch depend only on (seed, epoch, keys),
never on the number of ranks, so a run resumed under another data-parallel size sees the same
samples in the same steps — the property that makes losses comparable across layouts.

With ``keys`` (one hashable per sample: a video's (frames, height, width) bucket, or a text
length group from `length_groups`) every global batch holds one key only: indices are shuffled
within each key, cut into global batches, and the batches of all keys shuffled together. A key's
remainder smaller than a batch waits for the next epoch's shuffle (``drop_last``) or forms a
short batch (one rank only). The position in the stream is two integers, (epoch, batch in epoch).

With ``global_batch_tokens`` instead of ``global_batch_size`` a global batch counts tokens (the
first of each sample's ``costs``): the shuffled samples are taken in order while the batch stays
within the budget, and at least ``dp_size`` of them (every rank gets one), so a batch holds as
many samples as fit (LLaMA-Factory's and VeOmni's token-budget batches, cut the same on every
layout). The number of batches then differs between epochs and `state_at` walks the epochs; the
first epoch reads every sample's cost (headers and probes, once).

With ``blocks`` (the rows of each block of a sharded set, in order: `mm_data.shards.ShardSet`)
an epoch reads the shards in order rather than jumping between them: the blocks are shuffled,
taken ``window`` at a time, and the samples shuffled within each window; a key's samples are cut
into batches in that order (its remainder joins the next window's), and each batch goes out with
the window it completes in, the batches of a window shuffled. A rank then reads at most about
``window`` blocks at a time, each once. The epoch's batches are still a function of (seed, epoch,
blocks, keys) alone — the same on every layout, and a resume at any step computes its position
without reading a sample (measured: `state_at(100_000)` and the batch there on 40,000 samples in
the third epoch take 0.1 s here).

With ``indices`` the sampler draws from those samples only (a held-out split's complement, or the
split itself): `held_out_split` fixes which by the seed alone, so every layout and every resumed
run holds out the same samples, and a bad sample is replaced from within the same part.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np

from mm_data.balance import balance
from mm_data.errors import BadSample, DataError

HELD_OUT_STREAM = 0x4E1D  # a stream of the seed no other draw uses


def length_groups(lengths: Sequence[int], width: int = 256) -> List[int]:
    """Keys that group samples whose lengths fall in the same ``width``-token band."""
    return [int(math.ceil(length / width)) for length in lengths]


def held_out_split(num_samples: int, fraction: float, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """(training indices, held-out indices), both sorted: round(fraction * num_samples) samples
    (at least one) drawn by ``seed`` alone, whatever the layout."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"the held-out fraction must lie in (0, 1), got {fraction}")
    held = max(1, int(round(fraction * num_samples)))
    if held >= num_samples:
        raise DataError(f"holding out {held} of {num_samples} samples leaves none to train on; lower the fraction "
                        "or add data")
    chosen = np.random.default_rng([seed, HELD_OUT_STREAM]).permutation(num_samples)[:held]
    mask = np.zeros(num_samples, bool)
    mask[chosen] = True
    return np.flatnonzero(~mask), np.flatnonzero(mask)


class BucketBatchSampler:
    """See the module docstring."""

    def __init__(self, num_samples: int, global_batch_size: Optional[int], dp_rank: int = 0, dp_size: int = 1,
                 keys: Optional[Sequence[Hashable]] = None, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True, indices: Optional[Sequence[int]] = None,
                 costs: Optional[Callable[[int], Sequence[float]]] = None, global_batch_tokens: Optional[int] = None,
                 blocks: Optional[Sequence[int]] = None, window: int = 8):
        if (global_batch_size is None) == (global_batch_tokens is None):
            raise ValueError("set exactly one of global_batch_size (samples) and global_batch_tokens (tokens)")
        if global_batch_tokens is not None and (global_batch_tokens < 1 or costs is None):
            raise ValueError(f"global_batch_tokens={global_batch_tokens} must be >= 1 and needs costs (each "
                             "sample's tokens first)")
        if global_batch_size is not None and (global_batch_size < 1 or global_batch_size % dp_size):
            raise ValueError(f"global_batch_size={global_batch_size} must be a positive multiple of the "
                             f"data-parallel size {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, {dp_size})")
        if not drop_last and dp_size > 1:
            raise ValueError("drop_last=False makes short batches that cannot be split evenly over "
                             f"{dp_size} data-parallel ranks; use drop_last=True (short batches are for one rank)")
        if keys is not None and len(keys) != num_samples:
            raise ValueError(f"{len(keys)} keys for {num_samples} samples")
        if blocks is not None and (sum(blocks) != num_samples or window < 1):
            raise ValueError(f"blocks of {sum(blocks)} rows for {num_samples} samples, window {window}: the blocks "
                             "must hold every sample once and the window be >= 1")
        self.blocks, self.window = (None if blocks is None else np.asarray(blocks, np.int64)), window
        self.num_samples, self.global_batch_size, self.global_batch_tokens = (num_samples, global_batch_size,
                                                                              global_batch_tokens)
        self.dp_rank, self.dp_size, self.seed, self.shuffle, self.drop_last = dp_rank, dp_size, seed, shuffle, drop_last
        chosen = range(num_samples) if indices is None else [int(i) for i in indices]
        if indices is not None and any(not 0 <= i < num_samples for i in chosen):
            raise ValueError(f"indices must lie in [0, {num_samples})")
        self.groups: Dict[Hashable, np.ndarray] = defaultdict(list)
        for index in chosen:
            self.groups[keys[index] if keys is not None else 0].append(index)
        self.groups = {key: np.asarray(members, np.int64) for key, members in self.groups.items()}
        self.key_of = list(keys) if keys is not None else None
        self.costs, self._cost_of = costs, {}  # sample -> its costs (tokens, vision tokens, ...), read once
        self._cached_epoch, self._cached = None, []
        if not self.epoch_batches(0):
            sizes = {str(k): len(v) for k, v in self.groups.items()}
            size = global_batch_size if global_batch_tokens is None else f"{global_batch_tokens} tokens"
            raise DataError(f"no global batch of {size} can be formed from {len(chosen)} samples "
                            f"(samples per bucket: {sizes}); lower the batch size or add data")

    @property
    def local_batch_size(self) -> int:
        if self.global_batch_size is None:
            raise ValueError("a sampler of global_batch_tokens has no fixed batch size")
        return self.global_batch_size // self.dp_size

    def _cut(self, members: np.ndarray) -> Tuple[List[np.ndarray], np.ndarray]:
        """(the global batches of one key's shuffled samples, the remainder)."""
        if self.global_batch_tokens is None:
            cut = len(members) // self.global_batch_size * self.global_batch_size
            return list(members[:cut].reshape(-1, self.global_batch_size)), members[cut:]
        batches, start, used = [], 0, 0.0
        for end, index in enumerate(members):
            tokens = self.cost(int(index))[0]
            if end - start >= self.dp_size and used + tokens > self.global_batch_tokens:
                batches.append(members[start:end])
                start, used = end, 0.0
            used += tokens
        rest = members[start:]
        if len(rest) >= self.dp_size and used >= self.global_batch_tokens:
            return batches + [rest], rest[:0]
        return batches, rest

    def epoch_batches(self, epoch: int) -> List[np.ndarray]:
        """The global batches of ``epoch``, in order."""
        if epoch != self._cached_epoch and self.blocks is not None:
            self._cached_epoch, self._cached = epoch, self._block_order_batches(epoch)
        if epoch != self._cached_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            batches = []
            for key in sorted(self.groups, key=repr):  # a fixed key order, whatever the insertion order
                members = self.groups[key]
                members = rng.permutation(members) if self.shuffle else members
                full, rest = self._cut(members)
                batches += full
                if len(rest) and not self.drop_last:
                    batches.append(rest)
            if self.shuffle:
                batches = [batches[i] for i in rng.permutation(len(batches))]
            self._cached_epoch, self._cached = epoch, batches
        return self._cached

    def _block_order_batches(self, epoch: int) -> List[np.ndarray]:
        """The module docstring's block order: (samples in window order, each one's window), cut per key."""
        rng = np.random.default_rng([self.seed, epoch])
        starts = np.concatenate([[0], np.cumsum(self.blocks)])
        order = rng.permutation(len(self.blocks)) if self.shuffle else np.arange(len(self.blocks))
        sequence, windows = [], []
        for number, first in enumerate(range(0, len(order), self.window)):
            members = np.concatenate([np.arange(starts[b], starts[b + 1]) for b in order[first:first + self.window]])
            sequence.append(rng.permutation(members) if self.shuffle else members)
            windows.append(np.full(len(members), number))
        sequence, windows = np.concatenate(sequence), np.concatenate(windows)
        window_of = np.empty(self.num_samples, np.int64)
        window_of[sequence] = windows
        rank_of = np.empty(self.num_samples, np.int64)
        rank_of[sequence] = np.arange(self.num_samples)
        batches = []
        for key in sorted(self.groups, key=repr):
            members = self.groups[key][np.argsort(rank_of[self.groups[key]], kind="stable")]
            full, rest = self._cut(members)
            batches += full + ([rest] if len(rest) and not self.drop_last else [])
        ties = rng.permutation(len(batches)) if self.shuffle else np.arange(len(batches))
        done = np.array([window_of[batch].max() for batch in batches], np.int64)
        return [batches[i] for i in np.lexsort((ties, done))]

    def local(self, batch: np.ndarray) -> np.ndarray:
        """This rank's share of a global batch: contiguous, or with ``costs`` the share
        `mm_data.balance` gives it (every kind of cost even across the ranks; shares may differ in
        size: for packed rows, whose number is free)."""
        if self.costs is None or self.dp_size == 1:
            share = len(batch) // self.dp_size
            return batch[self.dp_rank * share:(self.dp_rank + 1) * share]
        return batch[balance([self.cost(int(i)) for i in batch], self.dp_size)[self.dp_rank]]

    def cost(self, index: int) -> Sequence[float]:
        """``costs(index)``, kept; a bad sample costs nothing here (the loader replaces and counts it)."""
        if index not in self._cost_of:
            try:
                self._cost_of[index] = tuple(float(c) for c in np.atleast_1d(self.costs(index)))
            except BadSample:
                self._cost_of[index] = None
        known = self._cost_of[index]
        if known is None:
            width = next((len(c) for c in self._cost_of.values() if c is not None), 1)
            return (0.0,) * width
        return known

    def substitute(self, index: int, epoch: int, attempt: int, exclude=()) -> Optional[int]:
        """Another sample with the same key, to stand in for a bad one, never one of ``exclude``
        (the samples already found bad for this index); None when the bucket has no other.
        Deterministic: a function of (seed, epoch, index, attempt, exclude), so the same on every
        layout and after a resume."""
        members = self.groups[self.key_of[index] if self.key_of is not None else 0]
        if exclude:
            members = np.setdiff1d(members, np.fromiter(exclude, np.int64))
        if not len(members):
            return None
        rng = np.random.default_rng([self.seed, epoch, index, attempt + 1])
        return int(members[rng.integers(len(members))])

    def state(self, epoch: int, position: int) -> dict:
        """A position in the stream as a loader saves it (JSON): epoch, batch in the epoch, and the
        seed and global batch size it is only valid for."""
        state = {"epoch": epoch, "position": position, "seed": self.seed, "global_batch_size": self.global_batch_size}
        if self.global_batch_tokens is not None:
            state["global_batch_tokens"] = self.global_batch_tokens
        return state

    def state_at(self, step: int) -> dict:
        """The position at the start of training step ``step`` (one global batch a step; batches of
        samples: every epoch has as many as the first; of tokens: the epochs are walked)."""
        if self.global_batch_tokens is None:
            return self.state(*divmod(step, len(self.epoch_batches(0))))
        epoch = 0
        while step >= len(self.epoch_batches(epoch)):
            step -= len(self.epoch_batches(epoch))
            epoch += 1
        return self.state(epoch, step)

    def positions(self, epoch: int = 0, batch: int = 0):
        """(epoch, batch in epoch, global batch) from the given position on, forever."""
        while True:
            batches = self.epoch_batches(epoch)
            for position in range(batch, len(batches)):
                yield epoch, position, batches[position]
            epoch, batch = epoch + 1, 0
