"""Which source frames make a clip: target fps, frame-count buckets, temporal crop.

A clip of ``T`` frames at ``target_fps`` from a video at ``source_fps`` takes source frame
``start + floor(j * step)`` for ``j < T``, with ``step = source_fps / target_fps * speed``: a step
above 1 drops frames, below 1 repeats them. The clip spans ``floor((T - 1) * step) + 1`` source
frames, so a video of ``N`` frames holds at most ``ceil(N / step)`` of them.

Video VAEs compress time by a factor ``k`` after the first frame, so the frame count must be
``offset + k * n`` (Wan2.1 and CogVideoX: 1 + 4n). `FrameBuckets` picks the longest such count
that fits, up to ``num_frames``; videos shorter than ``min_frames`` are bad samples. The start
is random (training) or centred (evaluation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from mm_data.errors import BadSample


@dataclass(frozen=True)
class FrameBuckets:
    """Allowed clip lengths ``offset + multiple * n`` within [min_frames, num_frames]."""

    num_frames: int = 49
    min_frames: Optional[int] = None
    multiple: int = 4
    offset: int = 1

    def __post_init__(self):
        if self.multiple < 1 or self.offset < 0:
            raise ValueError(f"frame buckets need multiple >= 1 and offset >= 0, got {self.multiple}, {self.offset}")
        if self.fit(self.num_frames) != self.num_frames:
            raise ValueError(f"num_frames={self.num_frames} is not of the form {self.offset} + {self.multiple} * n; "
                             f"use {self.fit(self.num_frames) or self.offset + self.multiple}")
        if self.min_frames is not None and self.min_frames > self.num_frames:
            raise ValueError(f"min_frames={self.min_frames} is larger than num_frames={self.num_frames}")

    def fit(self, available: int) -> int:
        """The longest allowed length <= ``available`` (capped at num_frames); 0 if none."""
        available = min(available, self.num_frames)
        if available < max(self.offset, 1):
            return 0
        return self.offset + (available - self.offset) // self.multiple * self.multiple

    def length(self, available: int, source: str = "video") -> int:
        """The clip length for a video that holds ``available`` frames at the target fps."""
        length = self.fit(available)
        floor = self.min_frames if self.min_frames is not None else self.num_frames
        if length < max(floor, 1):
            raise BadSample(source, f"too short: {available} frames at the target fps, at least "
                                    f"{max(floor, 1)} needed (min_frames)")
        return length


def frame_step(source_fps: float, target_fps: Optional[float], speed: float = 1.0) -> float:
    """Source frames per clip frame."""
    if target_fps is None:
        return speed
    if target_fps <= 0 or source_fps <= 0:
        raise ValueError(f"fps must be positive, got source {source_fps}, target {target_fps}")
    return source_fps / target_fps * speed


def frames_available(num_source_frames: int, step: float) -> int:
    """How many clip frames fit in a video of ``num_source_frames`` frames."""
    if num_source_frames <= 0:
        return 0
    count = max(1, math.ceil(num_source_frames / step))
    while count > 1 and _last_offset(count, step) > num_source_frames - 1:  # float rounding guards
        count -= 1
    while _last_offset(count + 1, step) <= num_source_frames - 1:
        count += 1
    return count


def _last_offset(length: int, step: float) -> int:
    return int(math.floor((length - 1) * step + 1e-9))


def clip_indices(num_source_frames: int, length: int, step: float,
                 rng: Optional[np.random.Generator] = None) -> np.ndarray:
    """Source frame indices of a ``length``-frame clip: random start with ``rng``, else centred."""
    offsets = np.floor(np.arange(length) * step + 1e-9).astype(np.int64)
    slack = num_source_frames - 1 - int(offsets[-1])
    if slack < 0:
        raise ValueError(f"a clip of {length} frames with step {step} does not fit in {num_source_frames} frames")
    start = int(rng.integers(0, slack + 1)) if rng is not None else slack // 2
    return start + offsets
