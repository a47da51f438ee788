"""Condition embeddings the diffusers video transformers share: the sinusoid of a timestep and
the two-layer MLPs it (and the text, in Wan) goes through."""

from __future__ import annotations

import math

import numpy as np
from mindspore import nn

from mm_parallel.blocks import Activation, Linear


def timestep_sinusoid(timestep: np.ndarray, dim: int, flip_sin_to_cos: bool = True, shift: float = 0.0) -> np.ndarray:
    """diffusers' Timesteps(dim, flip_sin_to_cos, downscale_freq_shift=shift): [cos | sin] (or
    [sin | cos]) of t * 10000^(-i / (dim / 2 - shift)), in float32 as diffusers computes it.

    The frequencies are exp of the float32 exponents rounded once to float32 (an exp in float64):
    numpy's float32 exp and torch's each err by up to an ulp, which at t ~ 1000 moves an angle by
    ~6e-5. Rounded once, the table agrees with torch's within 6e-8 at the tiny test widths (the
    parity tests) and within torch's own rounding elsewhere (<= 6e-5 at width 3072, t < 1000)."""
    half = dim // 2
    exponent = (-math.log(10000) * np.arange(half, dtype=np.float32)) / np.float32(half - shift)
    frequencies = np.exp(exponent.astype(np.float64)).astype(np.float32)
    angles = np.asarray(timestep, np.float32).reshape(-1)[:, None] * frequencies[None, :]
    parts = [np.cos(angles), np.sin(angles)] if flip_sin_to_cos else [np.sin(angles), np.cos(angles)]
    out = np.concatenate(parts, -1)
    return np.pad(out, ((0, 0), (0, dim % 2))) if dim % 2 else out


class TwoLayerMLP(nn.Cell):
    """linear_2(act(linear_1(x))): diffusers' TimestepEmbedding (without cond_proj) and
    PixArtAlphaTextProjection, with their parameter names."""

    def __init__(self, in_features: int, hidden: int, act: str):
        super().__init__()
        self.linear_1 = Linear(in_features, hidden)
        self.act = Activation(act)
        self.linear_2 = Linear(hidden, hidden)

    def construct(self, x):
        return self.linear_2(self.act(self.linear_1(x)))
