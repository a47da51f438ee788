"""Qwen3VLVideoProcessor: transformers 5.24's Qwen3-VL video processor, numpy in and out, no torch.

What differs from Qwen2-VL's (whose resizing, patch order and byte fast path are reused):

* defaults: patches of 16 merged 2 x 2 (32-pixel units), mean = std = 0.5, 2 frames per second,
  ``size`` {"shortest_edge": 128 x 32 x 32, "longest_edge": 768 x 32 x 32};
* frames: n = int(total / video_fps x fps) clipped to [min_frames, min(max_frames, total)]
  (or ``num_frames``), taken at round(linspace(0, total - 1, n));
* size: `smart_resize_video` bounds the pixels of the whole clip, frames x height x width (the
  frame count rounded to temporal patches), so longer clips get smaller frames; with
  ``cap_pixels_per_frame`` each frame is also held to max_video_tokens x 32^2 pixels and an even
  share of ``longest_edge``, floored at 1.05 x shortest_edge (qwen-vl-utils' rule);
* `timestamps`: the time of each temporal patch, the mean of its first and last frame's time
  (the processor's ``_calculate_timestamps``), which the chat template writes as
  ``<t seconds>`` before that patch's placeholders.

Frames are resized with PIL's bicubic filter, as images are (see mm_data.vl.video_processor).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import numpy as np

from mm_data.vl.video_processor import Qwen2VLVideoProcessor

HALF = (0.5, 0.5, 0.5)  # transformers' IMAGENET_STANDARD_MEAN / STD


def smart_resize_video(num_frames: int, height: int, width: int, temporal_factor: int = 2, factor: int = 32,
                       min_pixels: int = 128 * 32 * 32, max_pixels: int = 768 * 32 * 32) -> Tuple[int, int]:
    """(height, width) in multiples of ``factor`` with frames x height x width within [min, max]."""
    if num_frames < temporal_factor:
        raise ValueError(f"t:{num_frames} must be larger than temporal_factor:{temporal_factor}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    ratio = max(height, width) / min(height, width)
    if ratio > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {ratio}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class Qwen3VLVideoProcessor(Qwen2VLVideoProcessor):
    """See the module docstring. ``videos``: (T, H, W, C) uint8 arrays or lists of PIL frames."""

    def __init__(self, size=None, min_pixels: Optional[int] = None, max_pixels: Optional[int] = None,
                 image_mean: Sequence[float] = HALF, image_std: Sequence[float] = HALF, patch_size: int = 16,
                 fps: Optional[float] = 2, max_video_tokens: int = 768, **options):
        super().__init__(size=dict(size or {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}),
                         min_pixels=min_pixels, max_pixels=max_pixels, image_mean=image_mean, image_std=image_std,
                         patch_size=patch_size, fps=fps, max_video_tokens=max_video_tokens, **options)

    def sample_frames(self, total_num_frames: int, video_fps: Optional[float], num_frames: Optional[int] = None,
                      fps: Optional[float] = None) -> np.ndarray:
        if fps is not None and num_frames is not None:
            raise ValueError("`num_frames` and `fps` are mutually exclusive arguments, please use only one!")
        num_frames = num_frames if num_frames is not None else self.num_frames
        fps = fps if fps is not None else self.fps
        if num_frames is None and fps is not None:
            video_fps = video_fps or 24  # transformers' fallback when the container has no rate
            num_frames = int(total_num_frames / video_fps * fps)
            num_frames = min(max(num_frames, self.min_frames), self.max_frames, total_num_frames)
        if num_frames is None:
            num_frames = min(max(total_num_frames, self.min_frames), self.max_frames)
        if num_frames <= 0:
            raise ValueError(f"a video of {total_num_frames} frames gives no frame to sample")
        return np.linspace(0, total_num_frames - 1, num_frames).round().astype(np.int64)

    def target_size(self, num_frames: int, height: int, width: int) -> Tuple[int, int]:
        factor = self.patch_size * self.merge_size
        max_pixels = self.size["longest_edge"]
        if self.cap_pixels_per_frame:
            per_frame = max(min(self.max_video_tokens * factor * factor, self.size["longest_edge"] // num_frames),
                            int(self.size["shortest_edge"] * 1.05))
            max_pixels = per_frame * num_frames
        return smart_resize_video(num_frames, height, width, self.temporal_patch_size, factor,
                                  self.size["shortest_edge"], max_pixels)

    def timestamps(self, indices: Sequence[int], video_fps: Optional[float]) -> List[float]:
        """Seconds of each temporal patch of frames ``indices`` (module docstring)."""
        indices = list(indices)
        merge = self.temporal_patch_size
        if len(indices) % merge:
            indices += [indices[-1]] * (merge - len(indices) % merge)
        seconds = [index / (video_fps or 24) for index in indices]
        return [(seconds[i] + seconds[i + merge - 1]) / 2 for i in range(0, len(seconds), merge)]
