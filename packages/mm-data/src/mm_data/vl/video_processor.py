"""Qwen2VLVideoProcessor: transformers' Qwen2-VL video processor, numpy in and out, no torch.

Same constructor arguments (``size`` / ``min_pixels`` / ``max_pixels``, ``patch_size``,
``temporal_patch_size``, ``merge_size``, ``min_frames``, ``max_frames``, ``fps``, ``num_frames``,
``do_sample_frames``, ``cap_pixels_per_frame``, ``max_video_tokens``, mean / std ...), same
`sample_frames` rule and the same output keys (``pixel_values_videos`` (patches, C * T * P * P)
float32, ``video_grid_thw``) and patch order: frames are padded to a multiple of
``temporal_patch_size`` by repeating the last, and each temporal patch holds consecutive frames.

One difference, on purpose: frames are resized with PIL's bicubic filter, exactly as the PIL
image processor resizes images, so a video frame and a still image go through identical
arithmetic (a two-frame clip of one picture equals that picture through
`Qwen2VLImageProcessor`, bit for bit). transformers' video processor resizes with torchvision
instead, which differs from PIL by up to ~0.3 after normalisation (its image processors show the
same gap); torchvision cannot be installed beside the CPU torch here, so that path is not compared.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from mm_data.vl.image_processor import CLIP_MEAN, CLIP_STD, Qwen2VLImageProcessor, _for_each, byte_patches, smart_resize


class Qwen2VLVideoProcessor:
    """See the module docstring. ``videos``: (T, H, W, C) uint8 arrays or lists of PIL frames."""

    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(self, do_resize: bool = True, size: Optional[Dict[str, int]] = None, min_pixels: Optional[int] = None,
                 max_pixels: Optional[int] = None, do_rescale: bool = True, rescale_factor: float = 1 / 255,
                 do_normalize: bool = True, image_mean: Sequence[float] = CLIP_MEAN,
                 image_std: Sequence[float] = CLIP_STD, do_convert_rgb: bool = True, patch_size: int = 14,
                 temporal_patch_size: int = 2, merge_size: int = 2, min_frames: int = 4, max_frames: int = 768,
                 do_sample_frames: bool = False, fps: Optional[float] = None, num_frames: Optional[int] = None,
                 cap_pixels_per_frame: Optional[bool] = None, max_video_tokens: int = 128000, num_threads: int = 1):
        size = dict(size or {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768})
        self.frames = Qwen2VLImageProcessor(do_resize=do_resize, size=size, min_pixels=min_pixels,
                                            max_pixels=max_pixels, do_rescale=do_rescale,
                                            rescale_factor=rescale_factor, do_normalize=do_normalize,
                                            image_mean=image_mean, image_std=image_std, do_convert_rgb=do_convert_rgb,
                                            patch_size=patch_size, temporal_patch_size=1, merge_size=merge_size,
                                            num_threads=num_threads)
        self.size, self.do_resize = self.frames.size, do_resize
        self.patch_size, self.temporal_patch_size, self.merge_size = patch_size, temporal_patch_size, merge_size
        self.min_frames, self.max_frames, self.do_sample_frames = min_frames, max_frames, do_sample_frames
        self.fps, self.num_frames = fps, num_frames
        self.cap_pixels_per_frame, self.max_video_tokens = bool(cap_pixels_per_frame), max_video_tokens

    def to_dict(self) -> Dict:
        """The settings under transformers' names (a video_preprocessor_config.json's; this class's
        constructor reads them back)."""
        frames = {k: v for k, v in self.frames.to_dict().items() if k != "resample"}
        settings = {**frames, "temporal_patch_size": self.temporal_patch_size, "min_frames": self.min_frames,
                    "max_frames": self.max_frames, "do_sample_frames": self.do_sample_frames, "fps": self.fps,
                    "num_frames": self.num_frames, "max_video_tokens": self.max_video_tokens}
        if self.cap_pixels_per_frame:
            settings["cap_pixels_per_frame"] = True
        return settings

    def sample_frames(self, total_num_frames: int, video_fps: Optional[float], num_frames: Optional[int] = None,
                      fps: Optional[float] = None) -> np.ndarray:
        """Indices of the frames to keep: ``num_frames`` (rounded to temporal patches) or ``fps``
        per second within [min_frames, max_frames], spread evenly over the video."""
        if fps is not None and num_frames is not None:
            raise ValueError("`num_frames` and `fps` are mutually exclusive arguments, please use only one!")
        num_frames = num_frames if num_frames is not None else self.num_frames
        fps = fps if fps is not None else self.fps
        tps = self.temporal_patch_size
        if num_frames is not None:
            num_frames = round(num_frames / tps) * tps
        elif fps is not None:
            if not video_fps:
                raise ValueError("sampling `fps` frames per second needs the video's own fps")
            max_frames = math.floor(min(self.max_frames, total_num_frames) / tps) * tps
            num_frames = total_num_frames / video_fps * fps
            num_frames = min(max(num_frames, self.min_frames), max_frames, total_num_frames)
            num_frames = math.floor(num_frames / tps) * tps
        if num_frames is None:
            return np.arange(total_num_frames, dtype=np.int64)
        if num_frames > total_num_frames:
            raise ValueError(f"Video can't be sampled. The inferred `num_frames={num_frames}` exceeds "
                             f"`total_num_frames={total_num_frames}`. Decrease `num_frames` or `fps` for sampling.")
        if num_frames <= 0:
            raise ValueError(f"a video of {total_num_frames} frames gives no frame at this rate "
                             f"(temporal_patch_size={tps}); it is too short")
        # as torch.arange(0, total, total / num_frames).int(): the count and the steps in double,
        # each value rounded to float32, then truncated toward zero
        step = total_num_frames / num_frames
        count = int(math.ceil(total_num_frames / step))
        return (np.arange(count, dtype=np.float64) * step).astype(np.float32).astype(np.int64)

    def _max_pixels(self, num_frames: int) -> int:
        max_pixels = self.size["longest_edge"]
        if self.cap_pixels_per_frame:  # an even share of the whole video's token budget per frame
            factor = self.patch_size * self.merge_size
            total = int(self.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(min(max_pixels, total * self.temporal_patch_size // num_frames),
                             int(self.size["shortest_edge"] * 1.05))
        return max_pixels

    def target_size(self, num_frames: int, height: int, width: int) -> Tuple[int, int]:
        """(height, width) every frame of a clip of ``num_frames`` sampled frames is resized to."""
        return smart_resize(height, width, self.patch_size * self.merge_size, self.size["shortest_edge"],
                            self._max_pixels(num_frames))

    def __call__(self, videos, **_) -> Dict[str, np.ndarray]:
        videos = [videos] if isinstance(videos, np.ndarray) and videos.ndim == 4 else videos
        t, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        clips, grids = [], []
        for video in videos:
            frames = list(video)
            if not frames:
                raise ValueError("a video has no frames")
            clip = self._resized(frames)
            if len(clip) % t:  # pad to whole temporal patches with the last frame
                clip = np.concatenate([clip, np.repeat(clip[-1:], t - len(clip) % t, 0)])
            clips.append(clip)
            grids.append([len(clip) // t, clip.shape[1] // p, clip.shape[2] // p])
        rows = [int(np.prod(grid)) for grid in grids]
        tables = self.frames._tables
        if tables is None or any(clip.shape[-1] != 3 for clip in clips):
            normalized = [self.frames._rescale_normalize(np.moveaxis(clip, -1, 0)).swapaxes(0, 1) for clip in clips]
            patches = [self.patchify(np.asarray(clip, np.float32))[0] for clip in normalized]
            return {"pixel_values_videos": np.concatenate(patches, 0), "video_grid_thw": np.array(grids, np.int64)}
        pixel_values = np.empty((sum(rows), 3 * t * p * p), np.float32)
        pieces = []  # (clip, first temporal patch, how many, first output row): a few per clip, for the threads
        for clip, start, (grid_t, grid_h, grid_w) in zip(clips, np.cumsum([0] + rows), grids):
            step = -(-grid_t // max(self.frames.num_threads, 1))
            pieces += [(clip, first, min(step, grid_t - first), start + first * grid_h * grid_w)
                       for first in range(0, grid_t, step)]

        def fill(i):
            clip, first, count, row = pieces[i]
            patches_per_t = (clip.shape[1] // p) * (clip.shape[2] // p)
            byte_patches(clip[first * t:(first + count) * t], tables, p, m, t,
                         pixel_values[row:row + count * patches_per_t])

        _for_each(fill, len(pieces), self.frames.num_threads)
        return {"pixel_values_videos": pixel_values, "video_grid_thw": np.array(grids, np.int64)}

    preprocess = __call__

    def _resized(self, frames) -> np.ndarray:
        """(T, H, W, C) uint8: every frame converted and resized to the first frame's target size."""
        from PIL import Image

        first = frames[0] if isinstance(frames[0], Image.Image) else Image.fromarray(np.asarray(frames[0], np.uint8))
        size = self.target_size(len(frames), first.height, first.width) if self.do_resize else \
            (first.height, first.width)
        channels = 3 if self.frames.do_convert_rgb else len(first.getbands())
        clip = np.empty((len(frames),) + tuple(size) + (channels,), np.uint8)

        def fill(i):
            clip[i] = np.asarray(self.frames.resized(frames[i], size)).reshape(clip.shape[1:])

        _for_each(fill, len(frames), self.frames.num_threads)
        return clip

    def patchify(self, video: np.ndarray):
        """(T, C, H, W) -> (T/t * H/P * W/P, C t P P) patches in transformers' order, [grid t, h, w]."""
        num_frames, channels, height, width = video.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        if num_frames % t:
            video = np.concatenate([video, np.repeat(video[-1:], t - num_frames % t, 0)])
        grid_t, grid_h, grid_w = video.shape[0] // t, height // p, width // p
        blocks = video.reshape(grid_t, t, channels, grid_h // m, m, p, grid_w // m, m, p)
        blocks = blocks.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return blocks.reshape(grid_t * grid_h * grid_w, channels * t * p * p), [grid_t, grid_h, grid_w]
