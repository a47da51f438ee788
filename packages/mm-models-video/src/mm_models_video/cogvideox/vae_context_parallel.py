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

from mm_models_video import vae_frame_split as frame_split
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


def encode_shards(frames: int, n: int) -> List[Tuple[int, int]]:
    """Each rank's [start, end) of a clip's ``frames`` pixel frames (1 + 4k) for `encode`."""
    return frame_split.encode_shards(frames, n)


def decode_shards(latent_frames: int, n: int) -> List[Tuple[int, int]]:
    """Each rank's [start, end) of ``latent_frames`` latent frames for `decode` (module docstring)."""
    pairs, odd = divmod(latent_frames, 2)
    if pairs < n:
        raise frame_split.too_few(latent_frames, n)
    sizes = [2 * (pairs // n + (i < pairs % n)) for i in range(n)]
    sizes[0] += odd
    return frame_split.latent_shards(sizes)


def decoded_frames(start: int, end: int) -> Tuple[int, int]:
    """The pixel frames `decode` returns for latent frames [start, end) of a clip."""
    return frame_split.pixel_frames(start, end)


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
    its frames (mm_models_video.vae_frame_split.encode_gathered)."""
    return frame_split.encode_gathered(lambda frames: vae._encode_part(frames, FrameHalos(group)), video, group)
