"""The Wan VAEs' encode (2.1 and 2.2) with one clip's frames split over the ranks of a group
(context parallel): each rank holds a layer's activations for its own frames only, which is what
lets a long, large clip be encoded for training's feature cache.

The chunked encode (frame 0, then 4 at a time, each causal layer continuing from the chunk
before) equals one causal pass over the whole clip, so each rank runs its frames as one piece
(mm_models_video.vae_frame_split.encode_shards: rank 0 1 + 4a frames, the others 4b):

    causal conv       the 2 frames in front are the previous rank's last 2 input frames
                      (mm_parallel.mappings.ring_shift of every rank's tail); rank 0's are zeros
    downsample3d      stride-2 temporal convolution over the previous rank's last frame and this
                      rank's; rank 0 passes its first frame on as the chunked encode does
    AvgDown3D (2.2)   frame pairs never straddle two ranks: no communication
    norms, attention  per pixel or per frame: no communication
Inference only: the halos pass no gradient back (the VAE is frozen in training). Decoding stays
in one process (its frames are latent frames, 16 x 16 x 4 fewer).
"""

from __future__ import annotations

import numpy as np
from mindspore import Tensor, ops

from mm_models_video import vae_frame_split as frame_split
from mm_models_video.vae_common import LatentDistribution, moments_to_distribution
from mm_models_video.wan.vae import AutoencoderKLWan, patchify
from mm_models_video.wan.vae_layers import CACHE_T
from mm_parallel import mappings
from mm_parallel.topology import Group


class FrameHalos:
    """A frame stream (mm_models_video.wan.vae_layers) whose fronts come from the previous rank."""

    def __init__(self, group: Group):
        self.group = group
        self.first = group.rank == 0

    def front(self, conv, x):
        if x.shape[2] < CACHE_T:
            raise ValueError(f"a rank holds {x.shape[2]} frame at a causal convolution that pads {CACHE_T}: give "
                             "every rank at least 2 latent frames (fewer ranks or a longer clip)")
        previous = mappings.ring_shift(x[:, :, -CACHE_T:], self.group, 1)
        return None if self.first else previous

    def time_downsample(self, resample, x):
        previous = mappings.ring_shift(x[:, :, -1:], self.group, 1)
        if not self.first:
            return resample.time_conv.convolve(ops.concat([previous, x], 2))
        if x.shape[2] == 1:
            return x
        return ops.concat([x[:, :, :1], resample.time_conv.convolve(x)], 2)

    def time_upsample(self, resample, x):
        raise NotImplementedError("the Wan VAE decodes in one process")


def _frames(vae: AutoencoderKLWan, video):
    x = video if isinstance(video, Tensor) else Tensor(np.asarray(video, np.float32))
    if vae.use_tiling and (x.shape[3] > vae.tile_sample[0] or x.shape[4] > vae.tile_sample[1]):
        raise ValueError("spatial tiling and context parallelism do not combine: set vae.use_tiling = False or keep "
                         "frames within a tile")
    return patchify(x, vae.patch) if vae.patch > 1 else x


def encode(vae: AutoencoderKLWan, video_shard, group: Group) -> LatentDistribution:
    """This rank's latent distribution of the clip whose frames `encode_shards` gave it."""
    return moments_to_distribution(vae._encode_part(_frames(vae, video_shard), FrameHalos(group)))


def encode_shards(frames: int, n: int):
    """Each rank's [start, end) of a clip's ``frames`` pixel frames (1 + 4k) for `encode`."""
    return frame_split.encode_shards(frames, n)


def encode_gathered(vae: AutoencoderKLWan, video, group: Group) -> LatentDistribution:
    """The whole clip's latent distribution on every rank of ``group``, each having encoded only
    its frames (mm_models_video.vae_frame_split.encode_gathered)."""
    return frame_split.encode_gathered(lambda frames: vae._encode_part(_frames(vae, frames), FrameHalos(group)),
                                       video, group)
