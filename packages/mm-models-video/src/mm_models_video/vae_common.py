"""What the video VAEs share: torch-layout convolutions, per-frame application, the latent
distribution and GroupNorm over (C, T, H, W)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import ClassVar, Optional

import numpy as np
from mindspore import Tensor, nn, ops
from mindspore.common import dtype as mstype

from mm_models_video.diffusers_config import DIFFUSERS_VERSION
from mm_parallel import census
from mm_parallel.hf_checkpoint import load_weights, save_module
from mm_parallel.tensor_parallel import new_parameter


class DiffusersVAE(nn.Cell):
    """A VAE twin's diffusers folder: ``config`` (config.json fields, a dict) over the class's
    ``DEFAULTS`` (an unknown key is an error), `from_pretrained` and `save_pretrained`."""

    CLASS_NAME: ClassVar[str] = ""
    DEFAULTS: ClassVar[dict] = {}

    def __init__(self, config: Optional[dict] = None, **overrides):
        super().__init__()
        values = {**self.DEFAULTS, **{k: v for k, v in (config or {}).items() if not k.startswith("_")}, **overrides}
        unknown = set(values) - set(self.DEFAULTS)
        if unknown:
            raise ValueError(f"unknown {self.CLASS_NAME} config keys {sorted(unknown)}")
        self.config = values

    @classmethod
    def from_pretrained(cls, path, topology=None):
        with open(os.path.join(str(path), "config.json")) as f:
            model = cls(json.load(f))
        load_weights(model, str(path))
        return model

    def save_pretrained(self, path) -> None:
        """Write the diffusers folder (config.json, diffusion_pytorch_model.safetensors) that
        diffusers' class of the same name loads (tested); one process writes."""
        save_module(self, path, {"_class_name": self.CLASS_NAME, "_diffusers_version": DIFFUSERS_VERSION,
                                 **self.config}, base="diffusion_pytorch_model.safetensors")


class Conv(nn.Cell):
    """torch's Conv2d / Conv3d weights (out, in, *kernel) + bias, run by MindSpore's conv kernels
    (no padding: callers pad)."""

    def __init__(self, in_channels: int, out_channels: int, kernel, stride=1, bias: bool = True):
        super().__init__()
        self.kernel, self.stride = tuple(kernel), stride
        self.weight = new_parameter((out_channels, in_channels) + self.kernel, "weight", None, None)
        self.bias = new_parameter((out_channels,), "bias", None, None, zeros=True) if bias else None

    def construct(self, x):
        conv = ops.conv3d if len(self.kernel) == 3 else ops.conv2d
        out = conv(x, self.weight, None, stride=self.stride, pad_mode="valid")
        return out if self.bias is None else out + self.bias.reshape((1, -1) + (1,) * len(self.kernel))


def frames_as_batch(fn, x):
    """Apply a 2-D (b, c, h, w) function to every frame of (b, c, t, h, w)."""
    b, c, t, h, w = x.shape
    y = fn(x.transpose(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
    return y.reshape(b, t, y.shape[1], y.shape[2], y.shape[3]).transpose(0, 2, 1, 3, 4)


class GroupNorm(nn.Cell):
    """torch's GroupNorm over every dim after the channels (biased variance, affine)."""

    def __init__(self, groups: int, channels: int, eps: float = 1e-6):
        super().__init__()
        if channels % groups:
            raise ValueError(f"norm_num_groups={groups} must divide the {channels} channels")
        self.groups, self.eps = groups, eps
        self.weight = census.filled((channels,), "weight", 1.0)
        self.bias = census.filled((channels,), "bias", 0.0)

    def construct(self, x, sum_over_parts=None):
        """``sum_over_parts``: when x is one part of a larger input (frames split over ranks), a
        function summing a (b, groups, k) tensor over the parts; mean and variance then are the
        whole input's (two passes: the parts' sums and counts, then their centred squares; in
        float32 whatever x's dtype, as sums of millions of values need)."""
        shape = x.shape
        grouped = x.reshape(shape[0], self.groups, -1)
        if sum_over_parts is None:
            mean = grouped.mean(2, keep_dims=True)
            centred = grouped - mean
            var = (centred * centred).mean(2, keep_dims=True)
        else:
            wide = grouped.astype(mstype.float32)
            count = ops.full(grouped.shape[:2] + (1,), grouped.shape[2], dtype=mstype.float32)
            sums = sum_over_parts(ops.concat([wide.sum(2, keepdims=True), count], 2))
            centred = wide - sums[:, :, :1] / sums[:, :, 1:]
            var = sum_over_parts((centred * centred).sum(2, keepdims=True)) / sums[:, :, 1:]
            centred, var = centred.astype(grouped.dtype), var.astype(grouped.dtype)
        out = (centred * ops.rsqrt(var + self.eps)).reshape(shape)
        view = (1, -1) + (1,) * (len(shape) - 2)
        return out * self.weight.reshape(view) + self.bias.reshape(view)


@dataclass
class LatentDistribution:
    """diffusers' DiagonalGaussianDistribution of the encoder's (mean, logvar)."""
    mean: Tensor
    logvar: Tensor

    @property
    def std(self):
        return ops.exp(0.5 * self.logvar)

    def mode(self):
        return self.mean

    def sample(self, rng: np.random.Generator):
        noise = Tensor(rng.standard_normal(tuple(self.mean.shape)).astype(np.float32))
        return self.mean + self.std * noise


def moments_to_distribution(moments) -> LatentDistribution:
    """(mean, logvar clamped to [-30, 20]) from the encoder's 2 z channels."""
    mean, logvar = ops.split(moments, moments.shape[1] // 2, 1)
    return LatentDistribution(mean, ops.clip(logvar, -30.0, 20.0))


def tiled_spatially(x, tile, stride, blend, keep, run) -> np.ndarray:
    """diffusers' tiled_encode / tiled_decode: ``run`` on tiles of ``tile`` (h, w) input pixels
    every ``stride`` pixels; each tile's output blended into its upper and left neighbours' (already
    blended) outputs over ``blend`` rows / columns (weight y / blend), cropped to ``keep`` and joined."""
    rows = [[run(x[:, :, :, i:i + tile[0], j:j + tile[1]]).asnumpy().copy() for j in range(0, x.shape[4], stride[1])]
            for i in range(0, x.shape[3], stride[0])]
    joined = []
    for i, row in enumerate(rows):
        for j, out in enumerate(row):
            if i > 0:
                _blend(rows[i - 1][j], out, blend[0], 3)
            if j > 0:
                _blend(row[j - 1], out, blend[1], 4)
        joined.append(np.concatenate([out[:, :, :, :keep[0], :keep[1]] for out in row], 4))
    return np.concatenate(joined, 3)


def _blend(a: np.ndarray, b: np.ndarray, extent: int, axis: int) -> None:
    """b's first rows (or columns) along ``axis`` blended in place with a's last: weight y / extent."""
    extent = min(a.shape[axis], b.shape[axis], extent)
    for y in range(extent):
        index_b = [slice(None)] * 5
        index_a = list(index_b)
        index_b[axis], index_a[axis] = y, -extent + y
        b[tuple(index_b)] = a[tuple(index_a)] * (1 - y / extent) + b[tuple(index_b)] * (y / extent)
