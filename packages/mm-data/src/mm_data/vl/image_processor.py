"""Qwen2VLImageProcessor: the twin of transformers 5.24's Qwen2VLImageProcessorPil, numpy in and out.

Same constructor arguments and output keys (``pixel_values`` (patches, C * T * P * P) float32,
``image_grid_thw`` (images, 3) int64) and the same numbers bit for bit: the image is converted to
RGB, resized with PIL's bicubic filter to `smart_resize`'s size (multiples of patch x merge, pixel
count within [min_pixels, max_pixels], aspect kept), rescaled in float64 and cast to float32,
normalised per channel in float32, then cut into merge-ordered patches with each frame repeated
``temporal_patch_size`` times (a still image as a clip).

For RGB bytes (the usual case) the work is done on bytes: `byte_patches` moves them into patch
order and maps each through a per-channel table of the normalised values, which gives the same
numbers as the arithmetic (every output value depends only on the channel and the byte).
``num_threads`` (not in transformers; default 1) spreads a batch of images over threads.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP, transformers' OPENAI_CLIP_MEAN / STD
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 14 * 14 * 4 * 1280):
    """(height, width) rounded to multiples of ``factor`` with the pixel count in [min, max]."""
    if max(height, width) / min(height, width) > 200:
        ratio = max(height, width) / min(height, width)
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {ratio}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class Qwen2VLImageProcessor:
    """See the module docstring. ``images``: PIL images or (H, W, C) uint8 arrays."""

    model_input_names = ["pixel_values", "image_grid_thw"]

    def __init__(self, do_resize: bool = True, size: Optional[Dict[str, int]] = None, min_pixels: Optional[int] = None,
                 max_pixels: Optional[int] = None, do_rescale: bool = True, rescale_factor: float = 1 / 255,
                 do_normalize: bool = True, image_mean: Sequence[float] = CLIP_MEAN,
                 image_std: Sequence[float] = CLIP_STD, do_convert_rgb: bool = True, patch_size: int = 14,
                 temporal_patch_size: int = 2, merge_size: int = 2, num_threads: int = 1, resample: int = 3):
        if resample != 3:
            raise ValueError(f"resample={resample}: this processor resizes with PIL's bicubic filter only (3), as "
                             "Qwen2-VL's processors do by default")
        size = dict(size or {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280})
        if min_pixels is not None:
            size["shortest_edge"] = min_pixels
        if max_pixels is not None:
            size["longest_edge"] = max_pixels
        if not size.get("shortest_edge") or not size.get("longest_edge"):
            raise ValueError(f"size needs 'shortest_edge' (min pixels) and 'longest_edge' (max pixels), got {size}")
        self.size, self.do_resize, self.do_rescale, self.rescale_factor = size, do_resize, do_rescale, rescale_factor
        self.do_normalize, self.do_convert_rgb = do_normalize, do_convert_rgb
        self.image_mean, self.image_std = tuple(image_mean), tuple(image_std)
        self.patch_size, self.temporal_patch_size, self.merge_size = patch_size, temporal_patch_size, merge_size
        self.num_threads = num_threads
        # byte v of channel c after rescale and normalise, by the same arithmetic as a whole image
        bytes_per_channel = np.broadcast_to(np.arange(256, dtype=np.uint8), (len(self.image_mean), 256))
        lookup = self._rescale_normalize(bytes_per_channel) if do_rescale and do_normalize else None
        self._tables = None if lookup is None else [row.tolist() for row in lookup]

    def to_dict(self) -> Dict:
        """The settings under transformers' names (a preprocessor_config.json's, which
        transformers' Qwen2-VL image processors and this class's constructor both read)."""
        return {"do_resize": self.do_resize, "size": dict(self.size), "resample": 3,  # PIL bicubic, as resized here
                "do_rescale": self.do_rescale, "rescale_factor": self.rescale_factor,
                "do_normalize": self.do_normalize, "image_mean": list(self.image_mean),
                "image_std": list(self.image_std), "do_convert_rgb": self.do_convert_rgb,
                "patch_size": self.patch_size, "temporal_patch_size": self.temporal_patch_size,
                "merge_size": self.merge_size}

    def __call__(self, images, **_) -> Dict[str, np.ndarray]:
        images = [self._pil(image) for image in (images if isinstance(images, (list, tuple)) else [images])]
        t, p = self.temporal_patch_size, self.patch_size
        sizes = [self.target_size(pil) for pil in images]
        grids = np.array([[1, h // p, w // p] for h, w in sizes], np.int64)
        rows = [int(h * w) for _, h, w in grids]
        if self._tables is None or len(self.image_mean) != 3 or not self.do_convert_rgb:
            patches = [self.patchify(self.normalized(pil, size))[0] for pil, size in zip(images, sizes)]
            return {"pixel_values": np.concatenate(patches, 0), "image_grid_thw": grids}
        pixel_values = np.empty((sum(rows), 3 * t * p * p), np.float32)
        starts = np.cumsum([0] + rows)

        def fill(i):
            pixels = np.asarray(self.resized(images[i], sizes[i]))[None]
            byte_patches(pixels, self._tables, p, self.merge_size, t, pixel_values[starts[i]:starts[i] + rows[i]])

        _for_each(fill, len(images), self.num_threads)
        return {"pixel_values": pixel_values, "image_grid_thw": grids}

    preprocess = __call__

    @staticmethod
    def _pil(image):
        from PIL import Image

        return image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image, np.uint8))

    def target_size(self, image) -> Tuple[int, int]:
        """(height, width) the image is resized to."""
        height, width = (image.height, image.width) if hasattr(image, "height") else np.asarray(image).shape[:2]
        if not self.do_resize:
            return height, width
        return smart_resize(height, width, self.patch_size * self.merge_size, self.size["shortest_edge"],
                            self.size["longest_edge"])

    def resized(self, image, size: Optional[Tuple[int, int]] = None):
        """The PIL image converted to RGB and resized to `target_size` (or ``size`` = (h, w))."""
        from PIL import Image

        pil = self._pil(image)
        if self.do_convert_rgb and pil.mode != "RGB":
            pil = pil.convert("RGB")
        if self.do_resize:
            height, width = size or self.target_size(pil)
            pil = pil.resize((width, height), resample=Image.BICUBIC)
        return pil

    def normalized(self, image, size: Optional[Tuple[int, int]] = None) -> np.ndarray:
        """(C, H, W) float32: RGB, resized, rescaled and normalised as transformers does."""
        return self._rescale_normalize(np.moveaxis(np.asarray(self.resized(image, size)), -1, 0))

    def _rescale_normalize(self, array: np.ndarray) -> np.ndarray:
        """(C, ...) pixels rescaled in float64 then cast to float32, normalised per channel in float32."""
        if self.do_rescale:
            array = (array.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            array = array.astype(np.float32) if not np.issubdtype(array.dtype, np.floating) else array
            shape = (-1,) + (1,) * (array.ndim - 1)
            mean = np.array(self.image_mean, dtype=array.dtype).reshape(shape)
            std = np.array(self.image_std, dtype=array.dtype).reshape(shape)
            array = (array - mean) / std
        return array

    def patchify(self, image: np.ndarray):
        """(C, H, W) -> ((H/P) (W/P), C T P P) patches in merge-block order, grid h, grid w."""
        image = np.asarray(image, np.float32)
        channels, height, width = image.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_h, grid_w = height // p, width // p
        blocks = image.reshape(channels, grid_h // m, m, p, grid_w // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        clip = np.broadcast_to(blocks[:, :, :, :, :, None], blocks.shape[:5] + (t,) + blocks.shape[5:])
        return clip.reshape(grid_h * grid_w, channels * t * p * p), grid_h, grid_w


def _for_each(work, count: int, threads: int) -> None:
    """work(0..count-1), on ``threads`` threads (PIL's resize and point release the GIL)."""
    if threads <= 1 or count <= 1:
        for i in range(count):
            work(i)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(threads, count)) as pool:
        list(pool.map(work, range(count)))


def byte_patches(frames: np.ndarray, tables, patch: int, merge: int, temporal: int, out: np.ndarray) -> None:
    """Write the normalised patches of uint8 ``frames`` (F, H, W, 3) into ``out`` (rows, 3 t P P).

    ``F`` is a multiple of ``temporal`` (a clip) or 1 (a still image, repeated over the temporal
    patch). The bytes are put in patch order first (a quarter of the memory traffic of moving
    floats), then each channel goes through its 256-entry table of normalised values with PIL's
    ``point`` (a C loop): the same float32 numbers as rescaling and normalising every pixel.
    """
    from PIL import Image

    count, height, width, channels = frames.shape
    per_patch = 1 if count == 1 else temporal
    grid_t, grid_h, grid_w = count // per_patch, height // patch, width // patch
    blocks = frames.reshape(grid_t, per_patch, grid_h // merge, merge, patch, grid_w // merge, merge, patch, channels)
    blocks = blocks.transpose(8, 0, 2, 5, 3, 6, 1, 4, 7).reshape(channels, grid_t * grid_h * grid_w, -1)
    view = out.reshape(len(out), channels, temporal, patch * patch)
    for c in range(channels):
        values = np.asarray(Image.fromarray(np.ascontiguousarray(blocks[c])).point(tables[c], "F"))
        view[:, c] = values.reshape(len(out), per_patch, patch * patch)
