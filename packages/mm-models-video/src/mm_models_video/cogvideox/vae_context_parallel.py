"""CogVideoX's VAE with one clip's frames split over the ranks of a group (context parallel).

One process holds a layer's activations for every frame of the batch in hand; over n ranks each
holds its own frames', 1 / n of them, which is what lets a long, large clip be encoded for
training's feature cache. The function is the VAE's on the whole clip as one frame batch
(``num_sample_frames_batch_size`` / ``num_latent_frames_batch_size`` at least the clip's frames:
GroupNorm over every frame, as SAT's CogVideoX VAE and MindSpeed-MM's context-parallel one;
diffusers' default batches of 8 / 2 frames normalise per batch instead):

    frames      contiguous shards of latent frames, at least 2 per rank; rank 0's begin with the
                lone first frame. Encode: rank 0 takes 1 + 4a pixel frames, every other 4b, so
                the frame pairs the temporal downsamplers average never straddle two ranks.
                Decode: every rank but 0 an even number of latent frames (the upsamplers repeat
                frames, a lone first frame kept), rank 0 the clip's parity
    halo        a causal convolution of k frames pads its input in front with the previous
                rank's last k - 1 input frames (mm_parallel.mappings.ring_shift of every rank's
                tail); rank 0 repeats its first frame, as one process does
    GroupNorm   each group's mean over every rank's frames (an all-reduce of sums and counts),
                then its variance (an all-reduce of the centred squares)
Inference only: the statistics' all-reduce passes no gradient (the VAE is frozen in training).
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np
from mindspore import Tensor, ops

from mm_models_video.cogvideox.vae import AutoencoderKLCogVideoX, CausalContext
from mm_models_video.vae_common import LatentDistribution, moments_to_distribution
from mm_parallel import comm, mappings
from mm_parallel.topology import Group


class FrameHalos(CausalContext):
    """A CausalContext whose front padding and GroupNorm statistics come from the group."""

    def __init__(self, group: Group):
        super().__init__()
        self.group = group

    def pad_front(self, conv, x):
        if x.shape[2] < conv.time_pad:
            raise ValueError(f"a rank holds {x.shape[2]} frames at a causal convolution that pads {conv.time_pad}: "
                             "give every rank at least 2 latent frames (fewer ranks or a longer clip)")
        previous = mappings.ring_shift(x[:, :, -conv.time_pad:], self.group, 1)
        front = [x[:, :, :1]] * conv.time_pad if self.group.rank == 0 else [previous]
        return ops.concat(front + [x], 2)

    def group_norm(self, norm, x):
        return norm(x, lambda t: comm.all_reduce(t, self.group))


def _latent_shards(sizes: List[int]) -> List[Tuple[int, int]]:
    bounds = np.cumsum([0] + sizes)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def _pixels(start: int, end: int) -> Tuple[int, int]:
    """The pixel frames of latent frames [start, end): latent 0 is frame 0, latent j >= 1 frames 4j - 3 .. 4j."""
    return (0 if start == 0 else 4 * start - 3), 4 * end - 3


def _too_few(latent_frames: int, n: int):
    return ValueError(f"{latent_frames} latent frames cannot give each of {n} ranks 2: use fewer ranks or a "
                      "longer clip")


def _encode_latent_sizes(frames: int, n: int) -> List[int]:
    """The latent frames each rank's share of a clip of ``frames`` pixel frames (1 + 4k) encodes to."""
    if (frames - 1) % 4:
        raise ValueError(f"{frames} frames: the CogVideoX VAE encodes 1 + 4k frames")
    latent = (frames - 1) // 4 + 1
    if latent < 2 * n:
        raise _too_few(latent, n)
    return [latent // n + (i < latent % n) for i in range(n)]


def encode_shards(frames: int, n: int) -> List[Tuple[int, int]]:
    """Each rank's [start, end) of a clip's ``frames`` pixel frames (1 + 4k) for `encode`."""
    return [_pixels(a, b) for a, b in _latent_shards(_encode_latent_sizes(frames, n))]


def decode_shards(latent_frames: int, n: int) -> List[Tuple[int, int]]:
    """Each rank's [start, end) of ``latent_frames`` latent frames for `decode` (module docstring)."""
    pairs, odd = divmod(latent_frames, 2)
    if pairs < n:
        raise _too_few(latent_frames, n)
    sizes = [2 * (pairs // n + (i < pairs % n)) for i in range(n)]
    sizes[0] += odd
    return _latent_shards(sizes)


def decoded_frames(start: int, end: int) -> Tuple[int, int]:
    """The pixel frames `decode` returns for latent frames [start, end) of a clip."""
    return _pixels(start, end)


def _check_untiled(vae: AutoencoderKLCogVideoX, x, tile):
    if vae.use_tiling and (x.shape[3] > tile[0] or x.shape[4] > tile[1]):
        raise ValueError("spatial tiling and context parallelism do not combine yet: set vae.use_tiling = False "
                         "or keep frames within a tile")


def encode(vae: AutoencoderKLCogVideoX, video_shard, group: Group) -> LatentDistribution:
    """This rank's latent distribution of the clip whose frames `encode_shards` gave it (module docstring)."""
    x = video_shard if isinstance(video_shard, Tensor) else Tensor(np.asarray(video_shard, np.float32))
    _check_untiled(vae, x, vae.tile_sample)
    return moments_to_distribution(vae._encode_part(x, FrameHalos(group)))


def decode(vae: AutoencoderKLCogVideoX, latent_shard, group: Group) -> Tensor:
    """This rank's frames (`decoded_frames`) of the video of the latents `decode_shards` gave it."""
    z = latent_shard if isinstance(latent_shard, Tensor) else Tensor(np.asarray(latent_shard, np.float32))
    _check_untiled(vae, z, vae.tile_latent)
    return vae._decode_part(z, FrameHalos(group))


def encode_gathered(vae: AutoencoderKLCogVideoX, video, group: Group) -> LatentDistribution:
    """The whole clip's latent distribution on every rank of ``group``, each having encoded only
    its frames (`encode_shards`): feature extraction with the activations split, the latents
    joined (an all-gather of the shards, padded to the longest)."""
    video = np.asarray(video.asnumpy() if isinstance(video, Tensor) else video, np.float32)
    latent = _encode_latent_sizes(video.shape[2], group.size)  # latent frames per rank
    start, end = _pixels(*_latent_shards(latent)[group.rank])
    moments = vae._encode_part(Tensor(video[:, :, start:end]), FrameHalos(group))
    longest = max(latent)
    parts = comm.all_gather(ops.pad(moments, (0, 0, 0, 0, 0, longest - moments.shape[2])), group, dim=2)
    joined = ops.concat([parts[:, :, i * longest:i * longest + n] for i, n in enumerate(latent)], 2)
    return moments_to_distribution(joined)
