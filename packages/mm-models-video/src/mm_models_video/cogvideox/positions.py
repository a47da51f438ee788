"""CogVideoX's positions, computed on the host in numpy as diffusers computes them.

Rotary (1.0 5B, 1.5): the diffusers pipelines compute the tables outside the model and pass them
in as ``image_rotary_emb = (cos, sin)``, each (F * h * w, head_dim) over the video tokens of a
latent grid of F frames (1.5: F / patch_size_t) x h x w patches. The head's dims are split d/4
time, 3d/8 height, 3d/8 width, each axis's positions rotating interleaved pairs at frequencies
theta^(-2i / axis_dims):

    1.0   crop grid: the (h, w) grid resized to fit the base grid (sample size / patch) keeping its
          aspect, centred, positions linspace(crop_start, crop_stop (n - 1) / n, n); time likewise
          linspace(0, F (F - 1) / F, F)
    1.5   slice grid: integer positions 0 .. n - 1 of each axis

Sincos (1.0 2B) and learned (1.0 I2V) positions: a table over the joint text + video tokens, zero
on the text rows, added to the embeddings (`joint_position_table`).
"""

from __future__ import annotations

from typing import Tuple

import numpy as np

from mm_models_video.cogvideox.config import CogVideoXTransformerConfig


def crop_region(grid: Tuple[int, int], base_width: int, base_height: int):
    """diffusers' get_resize_crop_region_for_grid: ((top, left), (bottom, right)) of the (h, w)
    grid resized into the base grid, aspect kept, centred."""
    h, w = grid
    if h / w > base_height / base_width:
        height, width = base_height, int(round(base_height / h * w))
    else:
        width, height = base_width, int(round(base_width / w * h))
    top, left = int(round((base_height - height) / 2.0)), int(round((base_width - width) / 2.0))
    return (top, left), (top + height, left + width)


def _axis_tables(dim: int, positions: np.ndarray, theta: float):
    """cos, sin (n, dim) of positions at theta^(-2i / dim), each frequency twice (interleaved pairs):
    diffusers' get_1d_rotary_pos_embed(use_real=True) in float32."""
    freqs = (1.0 / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))).astype(np.float32)
    angles = np.outer(positions.astype(np.float32), freqs).astype(np.float32)
    return np.repeat(np.cos(angles), 2, axis=1), np.repeat(np.sin(angles), 2, axis=1)


def _linspace(start: float, stop: float, n: int) -> np.ndarray:
    return np.linspace(start, stop * (n - 1) / n, n, dtype=np.float64).astype(np.float32)


def rotary_tables(config: CogVideoXTransformerConfig, latent_frames: int, latent_height: int, latent_width: int,
                  theta: float = 10000.0):
    """(cos, sin), each (tokens, head_dim) float32, as the diffusers CogVideoX pipelines compute
    them for latents of ``latent_frames`` x ``latent_height`` x ``latent_width`` (module docstring)."""
    if not config.use_rotary_positional_embeddings:
        raise ValueError("this model uses sincos positions, not rotary ones (use_rotary_positional_embeddings false)")
    p, p_t = config.patch_size, config.patch_size_t
    grid_h, grid_w = latent_height // p, latent_width // p
    base_h, base_w = config.sample_height // p, config.sample_width // p
    if p_t is None:
        frames = latent_frames
        (top, left), (bottom, right) = crop_region((grid_h, grid_w), base_w, base_h)
        axes = (_linspace(0, frames, frames), _linspace(top, bottom, grid_h), _linspace(left, right, grid_w))
    else:
        frames = (latent_frames + p_t - 1) // p_t
        if grid_h > base_h or grid_w > base_w:
            raise ValueError(f"a {grid_h} x {grid_w} patch grid is larger than the model's sample grid {base_h} x "
                             f"{base_w} (sample_height / sample_width over patch_size): CogVideoX 1.5's slice "
                             "positions end there")
        axes = tuple(np.arange(n, dtype=np.float32) for n in (frames, grid_h, grid_w))  # the slice of max_size
    head = config.attention_head_dim
    dims = (head // 4, head // 8 * 3, head // 8 * 3)
    shape = (frames, grid_h, grid_w)
    out = []
    for part in (0, 1):  # cos, sin
        tables = []
        for axis, (dim, positions) in enumerate(zip(dims, axes)):
            table = _axis_tables(dim, positions, theta)[part]
            view = [1, 1, 1, dim]
            view[axis] = shape[axis]
            tables.append(np.broadcast_to(table.reshape(view), shape + (dim,)))
        out.append(np.ascontiguousarray(np.concatenate(tables, -1).reshape(-1, sum(dims)), np.float32))
    return out[0], out[1]


def _sincos(dim: int, positions: np.ndarray) -> np.ndarray:
    """[sin | cos] of positions at 10000^(-2i / dim): diffusers' get_1d_sincos_pos_embed_from_grid
    (frequencies in float64)."""
    omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
    angles = np.outer(positions.reshape(-1).astype(np.float64), omega)
    return np.concatenate([np.sin(angles), np.cos(angles)], 1)


def sincos_table(dim: int, width: int, height: int, frames: int, spatial_scale: float, temporal_scale: float):
    """diffusers' get_3d_sincos_pos_embed: (frames * height * width, dim) float64, the temporal
    quarter first, then the spatial 3/4 (its first half from the width position, then height)."""
    grid_h = np.arange(height, dtype=np.float32) / np.float32(spatial_scale)
    grid_w = np.arange(width, dtype=np.float32) / np.float32(spatial_scale)
    w_pos, h_pos = np.meshgrid(grid_w, grid_h, indexing="xy")  # (height, width) each
    spatial_dim = 3 * dim // 4
    spatial = np.concatenate([_sincos(spatial_dim // 2, w_pos), _sincos(spatial_dim // 2, h_pos)], 1)
    temporal = _sincos(dim // 4, np.arange(frames, dtype=np.float32) / np.float32(temporal_scale))
    spatial = np.broadcast_to(spatial[None], (frames,) + spatial.shape)
    temporal = np.broadcast_to(temporal[:, None, :], (frames, height * width, temporal.shape[1]))
    return np.concatenate([temporal, spatial], -1).reshape(frames * height * width, dim)


def joint_position_table(config: CogVideoXTransformerConfig, height: int, width: int, frames: int) -> np.ndarray:
    """(1, max_text_seq_length + patches, D) float32: zeros on the text rows, the sincos table of
    video of ``frames`` (before temporal compression) x ``height`` x ``width`` latent pixels on the rest
    (diffusers' CogVideoXPatchEmbed._get_positional_embeddings)."""
    p = config.patch_size
    h, w = height // p, width // p
    f = (frames - 1) // config.temporal_compression_ratio + 1
    video = sincos_table(config.inner_dim, w, h, f, config.spatial_interpolation_scale,
                         config.temporal_interpolation_scale)
    table = np.zeros((1, config.max_text_seq_length + video.shape[0], config.inner_dim), np.float64)
    table[0, config.max_text_seq_length:] = video
    return table.astype(np.float32)
