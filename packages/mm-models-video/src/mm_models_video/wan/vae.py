"""Wan2.1 video VAE: the MindSpore twin of diffusers' AutoencoderKLWan (the Wan2.1 layout, is_residual=False).

A causal 3-D convolutional autoencoder, 8x spatial and 4x temporal compression of 1 + 4k frames:

    encode: frames [0], [1..4], [5..8], ... go through the encoder one chunk at a time; every
            causal convolution prepends the last frames of the previous chunk's input (its feature
            cache) instead of zeros, so chunking equals one causal pass over the clip
            -> quant_conv -> (mean, logvar) of a diagonal Gaussian, z_dim channels each
    decode: post_quant_conv, then one latent frame at a time through the decoder (again with
            the caches), clamp to [-1, 1]; 1 + 4k latent... frames give 1 + 4(t - 1) video frames

Parameter names are diffusers' (``encoder.down_blocks.0.conv1.weight``, ``decoder.up_blocks.1.
upsamplers.0.time_conv.weight``, ``quant_conv.weight`` ...). `normalize_latents` /
`denormalize_latents` apply the config's latents_mean / latents_std as the Wan pipelines do.
Inference only (the VAE is frozen when training the DiT).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from mm_models_video.vae_common import Conv, DiffusersVAE, LatentDistribution, frames_as_batch, moments_to_distribution
from mm_parallel.blocks import Indexed
from mm_parallel.ops import attention

CACHE_T = 2  # frames of each convolution's input kept for the next chunk

_DEFAULTS = dict(base_dim=96, decoder_base_dim=None, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                 attn_scales=[], temperal_downsample=[False, True, True], dropout=0.0, latents_mean=None,
                 latents_std=None, is_residual=False, in_channels=3, out_channels=3, patch_size=None,
                 scale_factor_temporal=4, scale_factor_spatial=8)


class CausalConv3d(Conv):
    """Conv3d padded causally in time (2p frames before, none after) and by p on each spatial side.
    ``cache`` (a dict shared by the convolutions of one encode / decode) holds each one's last
    CACHE_T input frames; they stand in for the zero frames in front of the next chunk."""

    def __init__(self, in_channels: int, out_channels: int, kernel=3, stride=1, padding=0):
        kernel = (kernel,) * 3 if isinstance(kernel, int) else tuple(kernel)
        padding = (padding,) * 3 if isinstance(padding, int) else tuple(padding)
        super().__init__(in_channels, out_channels, kernel, stride)
        self.time_pad, self.spatial_pad = 2 * padding[0], (padding[1], padding[2])

    def construct(self, x, cache: Optional[Dict] = None):
        previous = None if cache is None else cache.get(id(self))
        if cache is not None:
            keep = x[:, :, -CACHE_T:]
            if keep.shape[2] < CACHE_T and previous is not None:
                keep = ops.concat([previous[:, :, -1:], keep], 2)
            cache[id(self)] = keep
        return self.convolve(x, previous)

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

    def construct(self, x, cache):
        shortcut = x if self.conv_shortcut is None else self.conv_shortcut(x)
        x = self.conv1(ops.silu(self.norm1(x)), cache)
        x = self.conv2(ops.silu(self.norm2(x)), cache)
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

    def construct(self, x, cache=None):
        return x + frames_as_batch(self._frame, x)


class _Upsample2x(nn.Cell):
    def construct(self, x):  # nearest(-exact) x2: every pixel repeated
        return ops.repeat_interleave(ops.repeat_interleave(x, 2, 2), 2, 3)


class _PadRightBottom(nn.Cell):
    def construct(self, x):
        return ops.pad(x, (0, 1, 0, 1))


class Resample(nn.Cell):
    """Spatial x2 up / down sampling per frame, with a causal temporal x2 in the "3d" modes."""

    def __init__(self, dim: int, mode: str):
        super().__init__()
        self.mode = mode
        if mode.startswith("upsample"):  # nearest x2, then a 3 x 3 convolution (padding 1) halving channels
            self.resample = Indexed(_Upsample2x(), Conv(dim, dim // 2, (3, 3)))
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

    def construct(self, x, cache):
        if self.mode == "upsample3d":
            x = self._time_upsample(x, cache)
        x = frames_as_batch(self._spatial, x)
        if self.mode == "downsample3d":
            x = self._time_downsample(x, cache)
        return x

    def _time_upsample(self, x, cache):
        """First chunk: the frame passes (marked "seen"); later: each frame becomes two."""
        key = id(self.time_conv)
        previous = cache.get(key)
        if previous is None:
            cache[key] = "seen"
            return x
        keep = x[:, :, -CACHE_T:]
        if keep.shape[2] < CACHE_T:
            head = ops.zeros_like(keep[:, :, -1:]) if isinstance(previous, str) else previous[:, :, -1:]
            keep = ops.concat([head, keep], 2)
        out = self.time_conv.convolve(x, None if isinstance(previous, str) else previous)
        cache[key] = keep
        b, c2, t, h, w = out.shape
        out = out.reshape(b, 2, c2 // 2, t, h, w)
        return ops.stack([out[:, 0], out[:, 1]], 3).reshape(b, c2 // 2, 2 * t, h, w)

    def _time_downsample(self, x, cache):
        """First chunk: kept whole, no temporal step; later: last frame of before + this chunk, stride 2."""
        key = id(self.time_conv)
        previous = cache.get(key)
        cache[key] = x if previous is None else x[:, :, -1:]
        if previous is None:
            return x
        return self.time_conv.convolve(ops.concat([previous[:, :, -1:], x], 2))


class MidBlock(nn.Cell):
    def __init__(self, dim: int):
        super().__init__()
        self.attentions = nn.CellList([AttentionBlock(dim)])
        self.resnets = nn.CellList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])

    def construct(self, x, cache):
        x = self.resnets[0](x, cache)
        return self.resnets[1](self.attentions[0](x), cache)


class Encoder3d(nn.Cell):
    def __init__(self, in_channels, dim, z_dim, dim_mult, num_res_blocks, attn_scales, temperal_downsample):
        super().__init__()
        dims = [dim * u for u in [1] + list(dim_mult)]
        self.conv_in = CausalConv3d(in_channels, dims[0], 3, padding=1)
        blocks, scale = [], 1.0
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            for _ in range(num_res_blocks):
                blocks.append(ResidualBlock(in_dim, out_dim))
                if scale in attn_scales:
                    blocks.append(AttentionBlock(out_dim))
                in_dim = out_dim
            if i != len(dim_mult) - 1:
                blocks.append(Resample(out_dim, "downsample3d" if temperal_downsample[i] else "downsample2d"))
                scale /= 2.0
        self.down_blocks = nn.CellList(blocks)
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = RMSNormChannels(dims[-1], images=False)
        self.conv_out = CausalConv3d(dims[-1], z_dim, 3, padding=1)

    def construct(self, x, cache):
        x = self.conv_in(x, cache)
        for block in self.down_blocks:
            x = block(x, cache)
        x = self.mid_block(x, cache)
        return self.conv_out(ops.silu(self.norm_out(x)), cache)


class UpBlock(nn.Cell):
    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, upsample_mode: Optional[str]):
        super().__init__()
        self.resnets = nn.CellList([ResidualBlock(in_dim if i == 0 else out_dim, out_dim)
                                    for i in range(num_res_blocks + 1)])
        self.upsamplers = None if upsample_mode is None else nn.CellList([Resample(out_dim, upsample_mode)])

    def construct(self, x, cache):
        for resnet in self.resnets:
            x = resnet(x, cache)
        return x if self.upsamplers is None else self.upsamplers[0](x, cache)


class Decoder3d(nn.Cell):
    def __init__(self, dim, z_dim, dim_mult, num_res_blocks, temperal_upsample, out_channels):
        super().__init__()
        dims = [dim * u for u in [dim_mult[-1]] + list(dim_mult)[::-1]]
        self.conv_in = CausalConv3d(z_dim, dims[0], 3, padding=1)
        self.mid_block = MidBlock(dims[0])
        blocks = []
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            in_dim = in_dim // 2 if i > 0 else in_dim  # the previous upsampler halved the channels
            up = i != len(dim_mult) - 1
            mode = ("upsample3d" if temperal_upsample[i] else "upsample2d") if up else None
            blocks.append(UpBlock(in_dim, out_dim, num_res_blocks, mode))
        self.up_blocks = nn.CellList(blocks)
        self.norm_out = RMSNormChannels(dims[-1], images=False)
        self.conv_out = CausalConv3d(dims[-1], out_channels, 3, padding=1)

    def construct(self, x, cache):
        x = self.mid_block(self.conv_in(x, cache), cache)
        for block in self.up_blocks:
            x = block(x, cache)
        return self.conv_out(ops.silu(self.norm_out(x)), cache)


class AutoencoderKLWan(DiffusersVAE):
    """See the module docstring. ``config``: diffusers' config.json fields (dict)."""

    CLASS_NAME, DEFAULTS = "AutoencoderKLWan", _DEFAULTS

    def __init__(self, config: Optional[dict] = None, **overrides):
        super().__init__(config, **overrides)
        values = self.config
        if values["is_residual"] or values["patch_size"]:
            raise ValueError("is_residual / patch_size describe the Wan2.2 VAE; this is the Wan2.1 one")
        z, mult, res = values["z_dim"], values["dim_mult"], values["num_res_blocks"]
        self.encoder = Encoder3d(values["in_channels"], values["base_dim"], 2 * z, mult, res, values["attn_scales"],
                                 values["temperal_downsample"])
        self.quant_conv = CausalConv3d(2 * z, 2 * z, 1)
        self.post_quant_conv = CausalConv3d(z, z, 1)
        self.decoder = Decoder3d(values["decoder_base_dim"] or values["base_dim"], z, mult, res,
                                 list(values["temperal_downsample"])[::-1], values["out_channels"])

    def encode(self, video) -> LatentDistribution:
        """(B, C, 1 + 4k, H, W) in [-1, 1] -> latent distribution of (B, z, 1 + k, H/8, W/8)."""
        x = video if isinstance(video, Tensor) else Tensor(np.asarray(video, np.float32))
        frames = x.shape[2]
        cache: Dict = {}
        chunks: List[Tensor] = [self.encoder(x[:, :, :1], cache)]
        for start in range(1, frames, 4):
            chunks.append(self.encoder(x[:, :, start:start + 4], cache))
        return moments_to_distribution(self.quant_conv(ops.concat(chunks, 2) if len(chunks) > 1 else chunks[0]))

    def decode(self, latents) -> Tensor:
        """(B, z, t, h, w) -> video (B, C, 1 + 4(t - 1), 8h, 8w) clamped to [-1, 1]."""
        z = latents if isinstance(latents, Tensor) else Tensor(np.asarray(latents, np.float32))
        x = self.post_quant_conv(z)
        cache: Dict = {}
        frames = [self.decoder(x[:, :, i:i + 1], cache) for i in range(x.shape[2])]
        return ops.clip(ops.concat(frames, 2) if len(frames) > 1 else frames[0], -1.0, 1.0)

    def _stats(self, like):
        cfg = self.config
        if cfg["latents_mean"] is None or cfg["latents_std"] is None:
            raise ValueError("the config has no latents_mean / latents_std to normalise with")
        shape = (1, -1) + (1,) * (like.ndim - 2)
        mean = Tensor(np.asarray(cfg["latents_mean"], np.float32).reshape(shape))
        std = Tensor(np.asarray(cfg["latents_std"], np.float32).reshape(shape))
        return mean, std

    def normalize_latents(self, latents):
        """(z - mean) / std per channel: what the DiT is trained on (the Wan pipelines' convention)."""
        mean, std = self._stats(latents)
        return (latents - mean) * (1.0 / std)

    def denormalize_latents(self, latents):
        mean, std = self._stats(latents)
        return latents * std + mean
