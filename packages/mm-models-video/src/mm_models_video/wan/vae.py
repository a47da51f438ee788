"""The Wan video VAEs: the MindSpore twin of diffusers' AutoencoderKLWan, Wan2.1's layout and
Wan2.2's (TI2V-5B: ``is_residual``, ``patch_size`` 2, z_dim 48, 16 x 16 x 4 compression).

A causal 3-D convolutional autoencoder of 1 + 4k frames (8x spatial and 4x temporal in Wan2.1):

    patchify: (Wan2.2) every 2 x 2 pixels of a frame become 12 channels, so the encoder's 8x
            makes 16x (unpatchify after decoding)
    encode: frames [0], [1..4], [5..8], ... go through the encoder one chunk at a time; every
            causal convolution prepends the last frames of the previous chunk's input (its feature
            cache, mm_models_video.wan.vae_layers.ChunkCache) instead of zeros, so chunking equals
            one causal pass over the clip (which mm_models_video.wan.vae_context_parallel splits
            over ranks) -> quant_conv -> (mean, logvar) of a diagonal Gaussian, z_dim channels each
    decode: post_quant_conv, then one latent frame at a time through the decoder (again with
            the caches), clamp to [-1, 1]; 1 + k latent frames give 1 + 4k video frames
    tiling: `enable_tiling` encodes / decodes large frames in overlapping spatial tiles blended
            as diffusers' tiled_encode / tiled_decode (its tile sizes and strides)

Parameter names are diffusers' (``encoder.down_blocks.0.conv1.weight``, ``decoder.up_blocks.1.
upsamplers.0.time_conv.weight``, ``decoder.up_blocks.0.upsampler.resample.1.weight`` ...).
`normalize_latents` / `denormalize_latents` apply the config's latents_mean / latents_std as the
Wan pipelines do. Inference only (the VAE is frozen when training the DiT).
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np
from mindspore import Tensor, ops

from mm_models_video.vae_common import DiffusersVAE, LatentDistribution, moments_to_distribution, tiled_spatially
from mm_models_video.wan.vae_coders import Decoder3d, Encoder3d
from mm_models_video.wan.vae_layers import CausalConv3d, ChunkCache

_DEFAULTS = dict(base_dim=96, decoder_base_dim=None, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                 attn_scales=[], temperal_downsample=[False, True, True], dropout=0.0, latents_mean=None,
                 latents_std=None, is_residual=False, in_channels=3, out_channels=3, patch_size=None,
                 scale_factor_temporal=4, scale_factor_spatial=8)
TILE_SAMPLE, TILE_STRIDE = (256, 256), (192, 192)  # diffusers' enable_tiling defaults


def patchify(x, p: int):
    """(b, c, t, p*h, p*w) -> (b, c*p*p, t, h, w), channel c*p*p + q*p + r taking pixel row offset r,
    column offset q (diffusers' order)."""
    b, c, t, h, w = x.shape
    if h % p or w % p:
        raise ValueError(f"frames of {h} x {w} pixels cannot be cut into {p} x {p} patches: use sizes divisible by {p}")
    x = x.reshape(b, c, t, h // p, p, w // p, p).transpose(0, 1, 6, 4, 2, 3, 5)
    return x.reshape(b, c * p * p, t, h // p, w // p)


def unpatchify(x, p: int):
    """Inverse of `patchify`."""
    b, cpp, t, h, w = x.shape
    x = x.reshape(b, cpp // (p * p), p, p, t, h, w).transpose(0, 1, 4, 5, 3, 6, 2)
    return x.reshape(b, cpp // (p * p), t, h * p, w * p)


class AutoencoderKLWan(DiffusersVAE):
    """See the module docstring. ``config``: diffusers' config.json fields (dict)."""

    CLASS_NAME, DEFAULTS = "AutoencoderKLWan", _DEFAULTS

    def __init__(self, config: Optional[dict] = None, **overrides):
        super().__init__(config, **overrides)
        values = self.config
        z, mult, res, residual = values["z_dim"], values["dim_mult"], values["num_res_blocks"], values["is_residual"]
        self.encoder = Encoder3d(values["in_channels"], values["base_dim"], 2 * z, mult, res, values["attn_scales"],
                                 values["temperal_downsample"], residual)
        self.quant_conv = CausalConv3d(2 * z, 2 * z, 1)
        self.post_quant_conv = CausalConv3d(z, z, 1)
        self.decoder = Decoder3d(values["decoder_base_dim"] or values["base_dim"], z, mult, res,
                                 list(values["temperal_downsample"])[::-1], values["out_channels"], residual)
        self.use_tiling = False
        self.tile_sample, self.tile_stride = TILE_SAMPLE, TILE_STRIDE

    @property
    def patch(self) -> int:
        return self.config["patch_size"] or 1

    def enable_tiling(self, tile_sample_min_height: Optional[int] = None, tile_sample_min_width: Optional[int] = None,
                      tile_sample_stride_height: Optional[int] = None,
                      tile_sample_stride_width: Optional[int] = None) -> None:
        """Encode / decode frames larger than a tile in overlapping spatial tiles (diffusers'
        enable_tiling, same defaults: tiles of 256 pixels every 192)."""
        self.use_tiling = True
        self.tile_sample = (tile_sample_min_height or self.tile_sample[0], tile_sample_min_width or self.tile_sample[1])
        self.tile_stride = (tile_sample_stride_height or self.tile_stride[0],
                            tile_sample_stride_width or self.tile_stride[1])

    # -- encode --------------------------------------------------------------------------------

    def _encode_part(self, x, stream):
        """quant_conv(encoder(x)) of patchified frames x, the causal context from ``stream``."""
        return self.quant_conv(self.encoder(x, stream))

    def _encode_chunks(self, x):
        """diffusers' _encode loop: frame 0, then 4 frames at a time, one feature cache."""
        stream = ChunkCache()
        chunks: List[Tensor] = [self._encode_part(x[:, :, :1], stream)]
        for start in range(1, x.shape[2], 4):
            chunks.append(self._encode_part(x[:, :, start:start + 4], stream))
        return ops.concat(chunks, 2) if len(chunks) > 1 else chunks[0]

    def encode(self, video) -> LatentDistribution:
        """(B, C, 1 + 4k, H, W) in [-1, 1] -> latent distribution of (B, z, 1 + k, H/s, W/s), s the
        spatial compression (8, or 16 with patch_size 2)."""
        x = video if isinstance(video, Tensor) else Tensor(np.asarray(video, np.float32))
        height, width = x.shape[3:]
        x = patchify(x, self.patch) if self.patch > 1 else x
        if self.use_tiling and (width > self.tile_sample[1] or height > self.tile_sample[0]):
            return moments_to_distribution(Tensor(self._tiled_encode(x)))
        return moments_to_distribution(self._encode_chunks(x))

    def _tiled_encode(self, x) -> np.ndarray:
        ratio = self.config["scale_factor_spatial"] // self.patch  # the encoder's own compression
        latent_tile = [n // ratio for n in self.tile_sample]
        latent_stride = [n // ratio for n in self.tile_stride]
        blend = [t - s for t, s in zip(latent_tile, latent_stride)]
        out = tiled_spatially(x, self.tile_sample, self.tile_stride, blend, latent_stride, self._encode_chunks)
        return out[:, :, :, :x.shape[3] // ratio, :x.shape[4] // ratio]

    # -- decode --------------------------------------------------------------------------------

    def _decode_frames(self, z):
        """diffusers' _decode loop: post_quant_conv, then one latent frame at a time, one feature cache
        (patchified output)."""
        x = self.post_quant_conv(z)
        stream = ChunkCache()
        frames = []
        for i in range(x.shape[2]):
            stream.first = i == 0
            frames.append(self.decoder(x[:, :, i:i + 1], stream))
        return ops.concat(frames, 2) if len(frames) > 1 else frames[0]

    def decode(self, latents) -> Tensor:
        """(B, z, t, h, w) -> video (B, C, 1 + 4(t - 1), s h, s w) clamped to [-1, 1]."""
        z = latents if isinstance(latents, Tensor) else Tensor(np.asarray(latents, np.float32))
        ratio = self.config["scale_factor_spatial"]
        latent_tile = [n // ratio for n in self.tile_sample]
        if self.use_tiling and (z.shape[4] > latent_tile[1] or z.shape[3] > latent_tile[0]):
            out = Tensor(self._tiled_decode(z, latent_tile))
        else:
            out = self._decode_frames(z)
        out = unpatchify(out, self.patch) if self.patch > 1 else out
        return ops.clip(out, -1.0, 1.0)

    def _tiled_decode(self, z, latent_tile) -> np.ndarray:
        ratio, p = self.config["scale_factor_spatial"], self.patch
        latent_stride = [n // ratio for n in self.tile_stride]
        keep = [n // p for n in self.tile_stride]
        blend = [t // p - k for t, k in zip(self.tile_sample, keep)]
        out = tiled_spatially(z, latent_tile, latent_stride, blend, keep, self._decode_frames)
        return out[:, :, :, :z.shape[3] * ratio // p, :z.shape[4] * ratio // p]

    # -- latents for the transformer -----------------------------------------------------------

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
