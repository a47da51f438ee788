"""Aspect-ratio buckets and the resize + crop that brings a video to its bucket.

Each bucket is an aspect ratio (height / width) whose frame size is the largest one in multiples
of ``stride`` (the VAE's downsampling times the transformer's patch) with ``height * width <=
max_area``, as close to the ratio as 5% less area allows — or a frame size given outright
(``sizes``, e.g. Wan's 480 x 832 and 832 x 480). A video goes to the bucket nearest its own ratio
(in log space, so 2:1 and 1:2 are equally far from 1:1); videos more elongated than ``max_aspect`` are bad samples. The
frame is
resized, aspect kept, just enough to cover the bucket, then cropped (centre or random) to it —
so every batch of one bucket has one shape and no frame is stretched.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np

from mm_data.errors import BadSample

# height / width of the usual video and photo formats, portrait and landscape
DEFAULT_RATIOS = (1.0, 3 / 4, 4 / 3, 9 / 16, 16 / 9, 2 / 3, 3 / 2, 1 / 2, 2.0, 9 / 21, 21 / 9)


@dataclass(frozen=True)
class AspectBuckets:
    max_area: int = 480 * 832
    stride: int = 16
    ratios: Sequence[float] = DEFAULT_RATIOS
    max_aspect: float = 3.0
    sizes: Optional[Sequence[Tuple[int, int]]] = None  # explicit (height, width) buckets instead

    def __post_init__(self):
        if self.sizes is not None:
            bad = [size for size in self.sizes if size[0] % self.stride or size[1] % self.stride]
            if not self.sizes or bad:
                raise ValueError(f"sizes must be (height, width) multiples of stride={self.stride}, "
                                 f"got {bad or 'none'}")
            return
        if self.stride < 1 or self.max_area < self.stride * self.stride:
            raise ValueError(f"max_area={self.max_area} must hold at least one stride x stride block ({self.stride})")
        if not self.ratios or min(self.ratios) <= 0:
            raise ValueError(f"ratios must be positive height / width values, got {self.ratios}")

    def size(self, ratio: float) -> Tuple[int, int]:
        """(height, width) of the bucket of aspect ``ratio``."""
        return _bucket_size(self.max_area, self.stride, ratio)

    def bucket(self, height: int, width: int, source: str = "video") -> Tuple[int, int]:
        """The bucket size for a ``height`` x ``width`` video."""
        if height <= 0 or width <= 0:
            raise BadSample(source, f"frame size {height}x{width}")
        aspect = max(height / width, width / height)
        if aspect > self.max_aspect:
            raise BadSample(source, f"aspect ratio {aspect:.2f} is beyond max_aspect={self.max_aspect}")
        if self.sizes is not None:
            return tuple(min(self.sizes, key=lambda s: abs(math.log(s[0] / s[1]) - math.log(height / width))))
        ratio = min(self.ratios, key=lambda r: abs(math.log(r) - math.log(height / width)))
        return self.size(ratio)


@functools.lru_cache(maxsize=None)
def _bucket_size(max_area: int, stride: int, ratio: float) -> Tuple[int, int]:
    """Among frames in multiples of ``stride`` within ``max_area`` and within 10% of ``ratio``,
    the closest in aspect of those within 5% of the largest area (the closest overall if none)."""
    candidates = []
    for height in range(stride, max_area // stride + 1, stride):
        width = min(max(stride, round(height / ratio / stride) * stride), max_area // height // stride * stride)
        if width >= stride:
            candidates.append((abs(math.log(height / width) - math.log(ratio)), -height * width, height, width))
    near = [c for c in candidates if c[0] <= 0.1]
    if not near:
        return min(candidates)[2:]
    largest = -min(c[1] for c in near)
    return min(c for c in near if -c[1] >= 0.95 * largest)[2:]


def cover_size(height: int, width: int, target: Tuple[int, int]) -> Tuple[int, int]:
    """The smallest (height, width) with the video's aspect that covers ``target``."""
    scale = max(target[0] / height, target[1] / width)
    return max(target[0], round(height * scale)), max(target[1], round(width * scale))


def crop_box(size: Tuple[int, int], target: Tuple[int, int], rng: Optional[np.random.Generator] = None):
    """(top, left) of a ``target`` crop of a ``size`` frame: random with ``rng``, else centred."""
    spare_h, spare_w = size[0] - target[0], size[1] - target[1]
    if rng is None:
        return spare_h // 2, spare_w // 2
    return int(rng.integers(0, spare_h + 1)), int(rng.integers(0, spare_w + 1))
