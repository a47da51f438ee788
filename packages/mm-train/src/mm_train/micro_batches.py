"""How a rank's share of a step becomes micro-batches: the training loader and validation cut alike."""

from __future__ import annotations

from typing import Callable, Dict, List


class MicroBatches:
    """Collate a rank's share of a step into consecutive micro-batches of ``size`` samples."""

    def __init__(self, collate: Callable, size: int):
        self.collate, self.size = collate, size

    def __call__(self, samples: List[dict]) -> List[Dict]:
        return [self.collate(samples[i:i + self.size]) for i in range(0, len(samples), self.size)]


class Prompts:
    """A rank's share of a step's prompts as one list, as they are (train.objective grpo:
    mm_train.grpo_step makes the training micro-batches from their rollouts)."""

    def __call__(self, samples: List[dict]) -> List[List[dict]]:
        return [list(samples)]
