"""Learning-rate schedules: linear warmup, then cosine, linear or constant decay (Megatron's).

    step < warmup:          lr * (step + 1) / warmup
    warmup <= step:         p = min(1, (step - warmup) / decay_steps)
        cosine              min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2
        linear              lr - (lr - min_lr) * p
        constant            lr

``step`` counts optimizer steps from 0; ``decay_steps`` counts the steps after warmup over which
the rate falls to ``min_lr`` (and stays there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SCHEDULES = ("cosine", "linear", "constant")


@dataclass(frozen=True)
class LRSchedule:
    lr: float
    warmup_steps: int = 0
    decay_steps: int = 0
    style: str = "constant"
    min_lr: float = 0.0

    def __post_init__(self):
        if self.style not in SCHEDULES:
            raise ValueError(f"lr schedule {self.style!r} is unknown; use one of {', '.join(SCHEDULES)}")
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise ValueError("warmup_steps and decay_steps must be >= 0")
        if self.style != "constant" and self.decay_steps == 0:
            raise ValueError(f"a {self.style} schedule needs decay_steps > 0 (the steps after warmup)")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr must be between 0 and lr={self.lr}, got {self.min_lr}")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.style == "constant":
            return self.lr
        progress = min(1.0, (step - self.warmup_steps) / self.decay_steps)
        if self.style == "cosine":
            return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr - (self.lr - self.min_lr) * progress
