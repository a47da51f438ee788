"""CogVideoX's video VAE: the MindSpore twin of diffusers' AutoencoderKLCogVideoX.

A causal 3-D convolutional autoencoder, 8x spatial and 4x temporal compression of 1 + 4k frames:

    causal conv   a 3-D convolution whose time padding is the previous chunk's last k - 1 input
                  frames (its cache) or, on the first chunk, k - 1 copies of the first frame;
                  spatial padding zeros
    encoder       conv_in, down blocks (resnets of GroupNorm / SiLU / causal conv; a stride-2
                  3 x 3 conv per frame after a zero row / column at the far sides; the first
                  log2(4) blocks first average frame pairs, a lone first frame kept), mid block,
                  GroupNorm, SiLU, conv_out -> (mean, logvar) of z channels
    decoder       the mirror: up blocks repeat pixels (and the first log2(4) frames, a lone first
                  frame kept) before a 3 x 3 conv; its norms are spatial norms, GroupNorm(f) *
                  conv_y(zq) + conv_b(zq) of the latents zq resized (nearest) to f
    chunks        encode takes frames in batches of 8 (the remainder in the first), decode latent
                  frames in batches of 2, the caches carrying the causal context across, as
                  diffusers does; GroupNorm statistics are per chunk, so the chunking is part of
                  the function (num_sample_frames_batch_size / num_latent_frames_batch_size, as
                  diffusers names them; vae_context_parallel splits a whole clip over ranks)

Parameter names are diffusers' (``encoder.down_blocks.0.resnets.0.conv1.conv.weight``,
``decoder.up_blocks.0.resnets.0.norm1.conv_y.conv.weight`` ...). Latents for the transformer are
``scaling_factor`` x z (1.5 I2V image latents: see ``invert_scale_latents``). Inference only (the
VAE is frozen when training the DiT). `enable_tiling` encodes / decodes large frames in
overlapping spatial tiles blended as diffusers' tiled_encode / tiled_decode (in place, each tile
into its already-blended neighbours).
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import numpy as np
from mindspore import Tensor, nn, ops

from mm_models_video.vae_common import (
    Conv,
    DiffusersVAE,
    GroupNorm,
    LatentDistribution,
    frames_as_batch,
    moments_to_distribution,
    tiled_spatially,
)

DEFAULTS = dict(in_channels=3, out_channels=3, down_block_types=["CogVideoXDownBlock3D"] * 4,
                up_block_types=["CogVideoXUpBlock3D"] * 4, block_out_channels=[128, 256, 256, 512],
                latent_channels=16, layers_per_block=3, act_fn="silu", norm_eps=1e-6, norm_num_groups=32,
                temporal_compression_ratio=4, sample_height=480, sample_width=720, scaling_factor=1.15258426,
                shift_factor=None, latents_mean=None, latents_std=None, force_upcast=True, use_quant_conv=False,
                use_post_quant_conv=False, invert_scale_latents=False)
ENCODE_FRAMES, DECODE_FRAMES = 8, 2  # diffusers' num_sample_frames_batch_size / num_latent_frames_batch_size


class CausalContext:
    """What one encode or decode carries across its frame batches: each causal convolution's last
    k - 1 time-padded input frames (the next batch's front padding; the first batch repeats its
    first frame), and how a GroupNorm takes its statistics (over the batch in hand).
    mm_models_video.cogvideox.vae_context_parallel's FrameHalos takes both from the neighbours."""

    def __init__(self):
        self.tails: Dict[int, Tensor] = {}

    def pad_front(self, conv: "CausalConv3d", x):
        previous = self.tails.get(id(conv))
        x = ops.concat(([previous] if previous is not None else [x[:, :, :1]] * conv.time_pad) + [x], 2)
        self.tails[id(conv)] = x[:, :, -conv.time_pad:]
        return x

    def group_norm(self, norm: GroupNorm, x):
        return norm(x)


class CausalConv3d(nn.Cell):
    """diffusers' CogVideoXCausalConv3d (pad_mode "first"): time padding from ``context`` (a
    CausalContext), k - 1 copies of the first frame without one."""

    def __init__(self, in_channels: int, out_channels: int, kernel: int = 3):
        super().__init__()
        self.time_pad, self.spatial_pad = kernel - 1, (kernel - 1) // 2
        self.conv = Conv(in_channels, out_channels, (kernel,) * 3)

    def construct(self, x, context: Optional[CausalContext] = None):
        if self.time_pad:
            x = (context or CausalContext()).pad_front(self, x)
        p = self.spatial_pad
        return self.conv(ops.pad(x, (p, p, p, p, 0, 0)) if p else x)


def nearest_resize(x, size):
    """torch's F.interpolate(x, size, mode="nearest") over the dims after the channels."""
    for axis, (old, new) in enumerate(zip(x.shape[2:], size), 2):
        if old != new:
            index = np.minimum(np.floor(np.arange(new) * np.float32(old / new)).astype(np.int32), old - 1)
            x = ops.gather(x, Tensor(index), axis)
    return x


class SpatialNorm3D(nn.Cell):
    """diffusers' CogVideoXSpatialNorm3D: GroupNorm(f) * conv_y(zq) + conv_b(zq), zq resized to f
    (an odd clip's first frame resized alone)."""

    def __init__(self, channels: int, zq_channels: int, groups: int):
        super().__init__()
        self.norm_layer = GroupNorm(groups, channels, 1e-6)
        self.conv_y = CausalConv3d(zq_channels, channels, 1)
        self.conv_b = CausalConv3d(zq_channels, channels, 1)

    def construct(self, f, zq, cache=None):
        if f.shape[2] > 1 and f.shape[2] % 2 == 1:
            first = nearest_resize(zq[:, :, :1], (1,) + tuple(f.shape[3:]))
            rest = nearest_resize(zq[:, :, 1:], (f.shape[2] - 1,) + tuple(f.shape[3:]))
            zq = ops.concat([first, rest], 2)
        else:
            zq = nearest_resize(zq, tuple(f.shape[2:]))
        return cache.group_norm(self.norm_layer, f) * self.conv_y(zq, cache) + self.conv_b(zq, cache)


class ResnetBlock3D(nn.Cell):
    def __init__(self, in_channels: int, out_channels: int, groups: int, eps: float,
                 spatial_norm_dim: Optional[int] = None):
        super().__init__()
        if spatial_norm_dim is None:
            self.norm1, self.norm2 = GroupNorm(groups, in_channels, eps), GroupNorm(groups, out_channels, eps)
        else:
            self.norm1 = SpatialNorm3D(in_channels, spatial_norm_dim, groups)
            self.norm2 = SpatialNorm3D(out_channels, spatial_norm_dim, groups)
        self.spatial = spatial_norm_dim is not None
        self.conv1 = CausalConv3d(in_channels, out_channels)
        self.conv2 = CausalConv3d(out_channels, out_channels)
        self.conv_shortcut = Conv(in_channels, out_channels, (1, 1, 1)) if in_channels != out_channels else None

    def _norm(self, norm, x, zq, cache):
        return norm(x, zq, cache) if self.spatial else cache.group_norm(norm, x)

    def construct(self, x, zq, cache):
        h = self.conv1(ops.silu(self._norm(self.norm1, x, zq, cache)), cache)
        h = self.conv2(ops.silu(self._norm(self.norm2, h, zq, cache)), cache)
        return h + (x if self.conv_shortcut is None else self.conv_shortcut(x))


class Downsample3D(nn.Cell):
    """Average frame pairs (compress_time; a lone first frame kept), then per frame a zero row /
    column at the far sides and a stride-2 3 x 3 convolution."""

    def __init__(self, channels: int, compress_time: bool):
        super().__init__()
        self.compress_time = compress_time
        self.conv = Conv(channels, channels, (3, 3), stride=2)

    def construct(self, x):
        if self.compress_time:
            first, rest = (x[:, :, :1], x[:, :, 1:]) if x.shape[2] % 2 else (None, x)
            if rest.shape[2]:
                b, c, t, h, w = rest.shape
                rest = rest.reshape(b, c, t // 2, 2, h, w).mean(3)
            x = rest if first is None else (ops.concat([first, rest], 2) if rest.shape[2] else first)
        return frames_as_batch(lambda f: self.conv(ops.pad(f, (0, 1, 0, 1))), x)


def _repeat(x, axes):
    for axis in axes:
        x = ops.repeat_interleave(x, 2, axis)
    return x


class Upsample3D(nn.Cell):
    """Repeat pixels (compress_time: and frames, a lone first frame of an odd clip kept), then per
    frame a 3 x 3 convolution (padding 1)."""

    def __init__(self, channels: int, compress_time: bool):
        super().__init__()
        self.compress_time = compress_time
        self.conv = Conv(channels, channels, (3, 3))

    def construct(self, x):
        t = x.shape[2]
        if self.compress_time and t > 1 and t % 2:
            x = ops.concat([_repeat(x[:, :, :1], (3, 4)), _repeat(x[:, :, 1:], (2, 3, 4))], 2)
        elif self.compress_time and t > 1:
            x = _repeat(x, (2, 3, 4))
        else:
            x = _repeat(x, (3, 4))
        return frames_as_batch(lambda f: self.conv(ops.pad(f, (1, 1, 1, 1))), x)


class _Block(nn.Cell):
    """CogVideoXDownBlock3D / UpBlock3D / MidBlock3D: resnets, then the resampler (if any)."""

    def __init__(self, channels_in: int, channels: int, layers: int, cfg: dict, spatial_norm_dim=None,
                 sampler=None, sampler_name: str = ""):
        super().__init__()
        groups, eps = cfg["norm_num_groups"], cfg["norm_eps"]
        self.resnets = nn.CellList([ResnetBlock3D(channels_in if i == 0 else channels, channels, groups, eps,
                                                  spatial_norm_dim) for i in range(layers)])
        self.sampler_name = sampler_name if sampler is not None else None
        if sampler is not None:  # diffusers' "downsamplers.0" / "upsamplers.0"
            setattr(self, sampler_name, nn.CellList([sampler]))

    def construct(self, x, zq, cache):
        for resnet in self.resnets:
            x = resnet(x, zq, cache)
        return x if self.sampler_name is None else getattr(self, self.sampler_name)[0](x)


class Encoder3D(nn.Cell):
    def __init__(self, cfg: dict):
        super().__init__()
        channels, levels = cfg["block_out_channels"], int(math.log2(cfg["temporal_compression_ratio"]))
        self.conv_in = CausalConv3d(cfg["in_channels"], channels[0])
        blocks = []
        for i, out in enumerate(channels):
            last = i == len(channels) - 1
            down = None if last else Downsample3D(out, compress_time=i < levels)
            blocks.append(_Block(channels[i - 1] if i else channels[0], out, cfg["layers_per_block"], cfg,
                                 sampler=down, sampler_name="downsamplers"))
        self.down_blocks = nn.CellList(blocks)
        self.mid_block = _Block(channels[-1], channels[-1], 2, cfg)
        self.norm_out = GroupNorm(cfg["norm_num_groups"], channels[-1], 1e-6)
        self.conv_out = CausalConv3d(channels[-1], 2 * cfg["latent_channels"])

    def construct(self, x, cache):
        x = self.conv_in(x, cache)
        for block in self.down_blocks:
            x = block(x, None, cache)
        x = self.mid_block(x, None, cache)
        return self.conv_out(ops.silu(cache.group_norm(self.norm_out, x)), cache)


class Decoder3D(nn.Cell):
    def __init__(self, cfg: dict):
        super().__init__()
        channels = list(reversed(cfg["block_out_channels"]))
        z, levels = cfg["latent_channels"], int(math.log2(cfg["temporal_compression_ratio"]))
        self.conv_in = CausalConv3d(z, channels[0])
        self.mid_block = _Block(channels[0], channels[0], 2, cfg, spatial_norm_dim=z)
        blocks = []
        for i, out in enumerate(channels):
            last = i == len(channels) - 1
            up = None if last else Upsample3D(out, compress_time=i < levels)
            blocks.append(_Block(channels[i - 1] if i else channels[0], out, cfg["layers_per_block"] + 1, cfg,
                                 spatial_norm_dim=z, sampler=up, sampler_name="upsamplers"))
        self.up_blocks = nn.CellList(blocks)
        self.norm_out = SpatialNorm3D(channels[-1], z, cfg["norm_num_groups"])
        self.conv_out = CausalConv3d(channels[-1], cfg["out_channels"])

    def construct(self, z, cache):
        x = self.mid_block(self.conv_in(z, cache), z, cache)
        for block in self.up_blocks:
            x = block(x, z, cache)
        return self.conv_out(ops.silu(self.norm_out(x, z, cache)), cache)


def frame_batches(frames: int, size: int):
    """diffusers' chunking: max(frames // size, 1) batches of ``size``, the remainder in the first."""
    rest = frames % size
    return [(0 if i == 0 else size * i + rest, size * (i + 1) + rest) for i in range(max(frames // size, 1))]


def by_frame_batches(x, size: int, run):
    """``run(batch, context)`` on each frame batch of (B, C, T, H, W) ``x`` in turn, one
    CausalContext carried across; the outputs joined along time."""
    context = CausalContext()
    parts = [run(x[:, :, start:end], context) for start, end in frame_batches(x.shape[2], size)]
    return ops.concat(parts, 2) if len(parts) > 1 else parts[0]


class AutoencoderKLCogVideoX(DiffusersVAE):
    """See the module docstring. ``config``: diffusers' config.json fields (dict)."""

    CLASS_NAME, DEFAULTS = "AutoencoderKLCogVideoX", DEFAULTS

    def __init__(self, config: Optional[dict] = None, **overrides):
        super().__init__(config, **overrides)
        values = self.config
        for key, block in (("down_block_types", "CogVideoXDownBlock3D"), ("up_block_types", "CogVideoXUpBlock3D")):
            if any(name != block for name in values[key]):
                raise ValueError(f"{key} must all be {block}, got {values[key]}")
        self.encoder, self.decoder = Encoder3D(values), Decoder3D(values)
        out = values["out_channels"]  # diffusers sizes both by out_channels (unused by the checkpoints)
        self.quant_conv = Conv(2 * out, 2 * out, (1, 1, 1)) if values["use_quant_conv"] else None
        self.post_quant_conv = Conv(out, out, (1, 1, 1)) if values["use_post_quant_conv"] else None
        self.use_tiling = False
        self.enable_tiling()
        self.use_tiling = False
        # diffusers' attributes of the same names: frames per encode / decode batch (a larger value
        # than the clip's: the clip whole, its GroupNorm statistics over every frame)
        self.num_sample_frames_batch_size, self.num_latent_frames_batch_size = ENCODE_FRAMES, DECODE_FRAMES

    def enable_tiling(self, tile_sample_min_height: Optional[int] = None, tile_sample_min_width: Optional[int] = None,
                      tile_overlap_factor_height: Optional[float] = None,
                      tile_overlap_factor_width: Optional[float] = None) -> None:
        """Encode / decode frames larger than a tile in overlapping spatial tiles blended linearly
        (diffusers' enable_tiling, same defaults: half the sample size, overlaps 1/6 and 1/5)."""
        cfg, down = self.config, 2 ** (len(self.config["block_out_channels"]) - 1)
        self.use_tiling = True
        self.tile_sample = (tile_sample_min_height or cfg["sample_height"] // 2,
                            tile_sample_min_width or cfg["sample_width"] // 2)
        self.tile_latent = tuple(int(n / down) for n in self.tile_sample)
        self.tile_overlap = (tile_overlap_factor_height or 1 / 6, tile_overlap_factor_width or 1 / 5)

    def _encode_part(self, x, cache):
        moments = self.encoder(x, cache)
        return moments if self.quant_conv is None else self.quant_conv(moments)

    def _decode_part(self, z, cache):
        return self.decoder(z if self.post_quant_conv is None else self.post_quant_conv(z), cache)

    def _encode_tile(self, x):
        return by_frame_batches(x, self.num_sample_frames_batch_size, self._encode_part)

    def _decode_tile(self, z):
        return by_frame_batches(z, self.num_latent_frames_batch_size, self._decode_part)

    def encode(self, video) -> LatentDistribution:
        """(B, C, 1 + 4k, H, W) in [-1, 1] -> latent distribution of (B, z, 1 + k, H/8, W/8)."""
        x = video if isinstance(video, Tensor) else Tensor(np.asarray(video, np.float32))
        if self.use_tiling and (x.shape[3] > self.tile_sample[0] or x.shape[4] > self.tile_sample[1]):
            return moments_to_distribution(Tensor(tiled(x, self.tile_sample, self.tile_latent, self.tile_overlap,
                                                        self._encode_tile)))
        return moments_to_distribution(self._encode_tile(x))

    def decode(self, latents) -> Tensor:
        """(B, z, t, h, w) -> video (B, C, 1 + 4(t - 1), 8h, 8w) (not clamped, as diffusers)."""
        z = latents if isinstance(latents, Tensor) else Tensor(np.asarray(latents, np.float32))
        if self.use_tiling and (z.shape[3] > self.tile_latent[0] or z.shape[4] > self.tile_latent[1]):
            return Tensor(tiled(z, self.tile_latent, self.tile_sample, self.tile_overlap, self._decode_tile))
        return self._decode_tile(z)


def tiled(x, tile, out_tile, overlap, run) -> np.ndarray:
    """diffusers' CogVideoX tiling: tiles of ``tile`` (h, w) input pixels every tile x (1 - overlap)
    pixels, each output blended into its upper and left neighbours' over out_tile x overlap rows /
    columns, then cropped to out_tile minus that extent (mm_models_video.vae_common.tiled_spatially)."""
    stride = [int(t * (1 - f)) for t, f in zip(tile, overlap)]
    blend = [int(t * f) for t, f in zip(out_tile, overlap)]
    return tiled_spatially(x, tile, stride, blend, [t - e for t, e in zip(out_tile, blend)], run)
