"""The Wan VAEs' layers (2.1 and 2.2), and how a causal pass carries frames from one piece of a
clip to the next.

Every temporal operation is causal, so a clip can go through the VAE in pieces of frames. What
a piece needs from the frames before it is asked of a *frame stream*:

    front(conv, x)         the frames a causal convolution puts before x (None: zeros)
    time_downsample(r, x)  the stride-2 temporal convolution of a "downsample3d" Resample
    time_upsample(r, x)    the temporal convolution doubling the frames of an "upsample3d" one
    first                  whether this piece begins the clip (DupUp3D drops its duplicate)

`ChunkCache` is diffusers' feat_cache: one process, a piece being a chunk of frames (encode: 1,
then 4 at a time; decode: 1 latent frame at a time), each convolution keeping the last CACHE_T
frames of its input for the next chunk. mm_models_video.wan.vae_context_parallel's FrameHalos
runs each rank's frames as one piece and takes the fronts from the previous rank.

Parameter names are diffusers' (``down_blocks.0.resnets.1.conv2.weight``,
``up_blocks.1.upsampler.time_conv.weight`` ...).
"""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mm_models_video.vae_common import Conv, frames_as_batch
from mm_parallel.blocks import Indexed
from mm_parallel.ops import attention

CACHE_T = 2  # frames of each convolution's input kept for the next chunk


class ChunkCache:
    """diffusers' feat_cache for one encode or decode, keyed by the layer (see the module docstring)."""

    def __init__(self):
        self.tails: Dict[int, object] = {}
        self.first = True

    def front(self, conv, x):
        previous = self.tails.get(id(conv))
        keep = x[:, :, -CACHE_T:]
        if keep.shape[2] < CACHE_T and previous is not None:
            keep = ops.concat([previous[:, :, -1:], keep], 2)
        self.tails[id(conv)] = keep
        return previous

    def time_downsample(self, resample, x):
        """First chunk: kept whole, no temporal step; later: last frame of before + this chunk, stride 2."""
        key = id(resample.time_conv)
        previous = self.tails.get(key)
        self.tails[key] = x if previous is None else x[:, :, -1:]
        if previous is None:
            return x
        return resample.time_conv.convolve(ops.concat([previous[:, :, -1:], x], 2))

    def time_upsample(self, resample, x):
        """First chunk: the frame passes (marked "seen"); later: each frame becomes two."""
        key = id(resample.time_conv)
        previous = self.tails.get(key)
        if previous is None:
            self.tails[key] = "seen"
            return x
        keep = x[:, :, -CACHE_T:]
        if keep.shape[2] < CACHE_T:
            head = ops.zeros_like(keep[:, :, -1:]) if isinstance(previous, str) else previous[:, :, -1:]
            keep = ops.concat([head, keep], 2)
        out = resample.time_conv.convolve(x, None if isinstance(previous, str) else previous)
        self.tails[key] = keep
        return interleave_time(out)


def interleave_time(out):
    """(b, 2c, t, h, w) of the doubling convolution -> (b, c, 2t, h, w): each frame's two halves in turn."""
    b, c2, t, h, w = out.shape
    out = out.reshape(b, 2, c2 // 2, t, h, w)
    return ops.stack([out[:, 0], out[:, 1]], 3).reshape(b, c2 // 2, 2 * t, h, w)


class CausalConv3d(Conv):
    """Conv3d padded causally in time (2p frames before, none after) and by p on each spatial side;
    ``stream`` (see the module docstring) gives the frames that stand in for the zeros in front."""

    def __init__(self, in_channels: int, out_channels: int, kernel=3, stride=1, padding=0):
        kernel = (kernel,) * 3 if isinstance(kernel, int) else tuple(kernel)
        padding = (padding,) * 3 if isinstance(padding, int) else tuple(padding)
        super().__init__(in_channels, out_channels, kernel, stride)
        self.time_pad, self.spatial_pad = 2 * padding[0], (padding[1], padding[2])

    def construct(self, x, stream=None):
        return self.convolve(x, None if stream is None else stream.front(self, x))

    def convolve(self, x, previous=None):
        front = self.time_pad
        if previous is not None and front > 0:
            x = ops.concat([previous, x], 2)
            front -= previous.shape[2]
        h, w = self.spatial_pad
        if front or h or w:
            x = ops.pad(x, (w, w, h, h, front, 0))
        return super().construct(x)


class RMSNormChannels(nn.Cell):
    """diffusers' WanRMS_norm: x / max(||x||_2 over channels, 1e-12) * sqrt(C) * gamma."""

    def __init__(self, dim: int, images: bool = True):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = Parameter(Tensor(np.ones((dim,) + ((1, 1) if images else (1, 1, 1)), np.float32)), name="gamma")

    def construct(self, x):
        norm = ops.sqrt((x * x).sum(1, keepdims=True))
        return x / ops.maximum(norm, 1e-12) * self.scale * self.gamma


class ResidualBlock(nn.Cell):
    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.norm1 = RMSNormChannels(in_dim, images=False)
        self.conv1 = CausalConv3d(in_dim, out_dim, 3, padding=1)
        self.norm2 = RMSNormChannels(out_dim, images=False)
        self.conv2 = CausalConv3d(out_dim, out_dim, 3, padding=1)
        self.conv_shortcut = CausalConv3d(in_dim, out_dim, 1) if in_dim != out_dim else None

    def construct(self, x, stream):
        shortcut = x if self.conv_shortcut is None else self.conv_shortcut(x)
        x = self.conv1(ops.silu(self.norm1(x)), stream)
        x = self.conv2(ops.silu(self.norm2(x)), stream)
        return x + shortcut


class AttentionBlock(nn.Cell):
    """Single-head self-attention over the pixels of each frame."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = RMSNormChannels(dim)
        self.to_qkv = Conv(dim, dim * 3, (1, 1))
        self.proj = Conv(dim, dim, (1, 1))

    def _frame(self, x):
        n, c, h, w = x.shape
        qkv = self.to_qkv(self.norm(x)).reshape(n, 3 * c, h * w).transpose(0, 2, 1)  # (n, hw, 3c)
        q, k, v = (t.reshape(n, h * w, 1, c) for t in ops.split(qkv, c, 2))
        out = attention(q, k, v).reshape(n, h * w, c).transpose(0, 2, 1).reshape(n, c, h, w)
        return self.proj(out)

    def construct(self, x, stream=None):
        return x + frames_as_batch(self._frame, x)


class _Upsample2x(nn.Cell):
    def construct(self, x):  # nearest(-exact) x2: every pixel repeated
        return ops.repeat_interleave(ops.repeat_interleave(x, 2, 2), 2, 3)


class _PadRightBottom(nn.Cell):
    def construct(self, x):
        return ops.pad(x, (0, 1, 0, 1))


class Resample(nn.Cell):
    """Spatial x2 up / down sampling per frame, with a causal temporal x2 in the "3d" modes.
    ``out_dim``: the upsampling convolution's channels (Wan2.1 halves them, Wan2.2 keeps them)."""

    def __init__(self, dim: int, mode: str, out_dim: Optional[int] = None):
        super().__init__()
        self.mode = mode
        if mode.startswith("upsample"):  # nearest x2, then a 3 x 3 convolution (padding 1)
            self.resample = Indexed(_Upsample2x(), Conv(dim, out_dim or dim // 2, (3, 3)))
        else:  # zero row / column at the far sides, then a stride-2 3 x 3 convolution
            self.resample = Indexed(_PadRightBottom(), Conv(dim, dim, (3, 3), stride=2))
        self.conv_padding = 1 if mode.startswith("upsample") else 0
        self.time_conv = None
        if mode == "upsample3d":
            self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0))
        elif mode == "downsample3d":
            self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1))

    def _spatial(self, x):
        x = self.resample[0](x)
        if self.conv_padding:
            x = ops.pad(x, (1, 1, 1, 1))
        return self.resample[1](x)

    def construct(self, x, stream):
        if self.mode == "upsample3d":
            x = stream.time_upsample(self, x)
        x = frames_as_batch(self._spatial, x)
        if self.mode == "downsample3d":
            x = stream.time_downsample(self, x)
        return x


class MidBlock(nn.Cell):
    def __init__(self, dim: int):
        super().__init__()
        self.attentions = nn.CellList([AttentionBlock(dim)])
        self.resnets = nn.CellList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])

    def construct(self, x, stream):
        x = self.resnets[0](x, stream)
        return self.resnets[1](self.attentions[0](x), stream)


class AvgDown3D(nn.Cell):
    """Wan2.2's parameter-free shortcut around a downsampling block: frames zero-padded in front to a
    multiple of ``factor_t``, every factor_t x factor_s x factor_s block of each channel laid out as
    channels, then groups of ``in * factor / out`` consecutive channels averaged."""

    def __init__(self, in_channels: int, out_channels: int, factor_t: int, factor_s: int = 1):
        super().__init__()
        self.factor_t, self.factor_s, self.out_channels = factor_t, factor_s, out_channels
        if in_channels * factor_t * factor_s * factor_s % out_channels:
            raise ValueError(f"in_channels {in_channels} x {factor_t * factor_s * factor_s} must be a multiple of "
                             f"out_channels {out_channels}")

    def construct(self, x):
        ft, fs = self.factor_t, self.factor_s
        pad = (ft - x.shape[2] % ft) % ft
        if pad:
            x = ops.pad(x, (0, 0, 0, 0, pad, 0))
        b, c, t, h, w = x.shape
        x = x.reshape(b, c, t // ft, ft, h // fs, fs, w // fs, fs).transpose(0, 1, 3, 5, 7, 2, 4, 6)
        x = x.reshape(b, self.out_channels, -1, t // ft, h // fs, w // fs)
        return x.mean(2)


class DupUp3D(nn.Cell):
    """Wan2.2's parameter-free shortcut around an upsampling block: each channel repeated
    ``out * factor / in`` times, the copies laid out as a factor_t x factor_s x factor_s block; the
    clip's first piece keeps only the last of its first frame's factor_t copies."""

    def __init__(self, in_channels: int, out_channels: int, factor_t: int, factor_s: int = 1):
        super().__init__()
        self.factor_t, self.factor_s, self.out_channels = factor_t, factor_s, out_channels
        factor = factor_t * factor_s * factor_s
        if out_channels * factor % in_channels:
            raise ValueError(f"out_channels {out_channels} x {factor} must be a multiple of in_channels {in_channels}")
        self.repeats = out_channels * factor // in_channels

    def construct(self, x, first: bool = False):
        ft, fs = self.factor_t, self.factor_s
        b, _, t, h, w = x.shape
        x = ops.repeat_interleave(x, self.repeats, 1).reshape(b, self.out_channels, ft, fs, fs, t, h, w)
        x = x.transpose(0, 1, 5, 2, 6, 3, 7, 4).reshape(b, self.out_channels, t * ft, h * fs, w * fs)
        return x[:, :, ft - 1:] if first else x
