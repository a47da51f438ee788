"""A clip's frames split over the ranks of a group for a causal video VAE's encode (context
parallel): which frames each rank takes, and the whole clip's latents joined from the ranks'.

A causal VAE compresses 1 + 4k frames to 1 + k latent frames (latent 0 is frame 0, latent j >= 1
frames 4j - 3 .. 4j). Each rank takes a contiguous run of latent frames, at least 2 (a causal
convolution's front padding, 2 frames at the deepest level, comes from the previous rank alone):
rank 0 the 1 + 4a pixel frames of its latents, every other rank 4b, so the frame pairs a temporal
downsampler combines never straddle two ranks. The VAEs' own modules (mm_models_video.cogvideox.
vae_context_parallel, mm_models_video.wan.vae_context_parallel) say how a layer crosses ranks.
"""

from __future__ import annotations

from typing import Callable, List, Tuple

import numpy as np
from mindspore import Tensor, ops

from mm_models_video.vae_common import LatentDistribution, moments_to_distribution
from mm_parallel import comm
from mm_parallel.topology import Group


def latent_shards(sizes: List[int]) -> List[Tuple[int, int]]:
    """[start, end) of consecutive runs of ``sizes`` latent frames."""
    bounds = np.cumsum([0] + sizes)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def pixel_frames(start: int, end: int) -> Tuple[int, int]:
    """The pixel frames of latent frames [start, end): latent 0 is frame 0, latent j >= 1 frames 4j - 3 .. 4j."""
    return (0 if start == 0 else 4 * start - 3), 4 * end - 3


def too_few(latent_frames: int, n: int) -> ValueError:
    return ValueError(f"{latent_frames} latent frames cannot give each of {n} ranks 2: use fewer ranks or a "
                      "longer clip")


def encode_latent_sizes(frames: int, n: int) -> List[int]:
    """The latent frames each rank's share of a clip of ``frames`` pixel frames (1 + 4k) encodes to."""
    if (frames - 1) % 4:
        raise ValueError(f"{frames} frames: a causal video VAE encodes 1 + 4k frames")
    latent = (frames - 1) // 4 + 1
    if latent < 2 * n:
        raise too_few(latent, n)
    return [latent // n + (i < latent % n) for i in range(n)]


def encode_shards(frames: int, n: int) -> List[Tuple[int, int]]:
    """Each rank's [start, end) of a clip's ``frames`` pixel frames (1 + 4k) for a split encode."""
    return [pixel_frames(a, b) for a, b in latent_shards(encode_latent_sizes(frames, n))]


def encode_gathered(encode_part: Callable, video, group: Group) -> LatentDistribution:
    """The whole clip's latent distribution on every rank of ``group``, each having encoded only its
    frames (`encode_shards`) with ``encode_part(frames) -> moments``: feature extraction with the
    activations split, the latents joined (an all-gather of the shards, padded to the longest)."""
    video = np.asarray(video.asnumpy() if isinstance(video, Tensor) else video, np.float32)
    latent = encode_latent_sizes(video.shape[2], group.size)  # latent frames per rank
    start, end = pixel_frames(*latent_shards(latent)[group.rank])
    moments = encode_part(Tensor(video[:, :, start:end]))
    longest = max(latent)
    parts = comm.all_gather(ops.pad(moments, (0, 0, 0, 0, 0, longest - moments.shape[2])), group, dim=2)
    joined = ops.concat([parts[:, :, i * longest:i * longest + n] for i, n in enumerate(latent)], 2)
    return moments_to_distribution(joined)
