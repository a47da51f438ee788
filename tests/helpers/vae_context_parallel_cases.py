"""The video VAEs' context-parallel encode (and CogVideoX's decode) against one process on the
whole clip, inside one msrun launch: every rank encodes its frames (vae_context_parallel.
encode_shards) and decodes its latent frames, and compares its part with the one-process result
(each rank computes that too: the VAEs are tiny). The Wan VAEs (2.1 and 2.2) ride in the same
launch."""

from __future__ import annotations

import numpy as np

# 3 blocks (spatial / 4, time / 4), 4 groups
CONFIG = dict(block_out_channels=[8, 16, 16], latent_channels=4, layers_per_block=1, norm_num_groups=4,
              down_block_types=["CogVideoXDownBlock3D"] * 3, up_block_types=["CogVideoXUpBlock3D"] * 3,
              sample_height=32, sample_width=32)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def run_vae_cases(path: str, frames: int, size, wan_paths=(), wan_size=None):
    import mm_parallel
    from mm_models_video.cogvideox import vae_context_parallel as cp
    from mm_models_video.cogvideox.vae import AutoencoderKLCogVideoX

    topo = mm_parallel.initialize(mm_parallel.ParallelConfig())
    group, n = topo.world, topo.world_size
    vae = AutoencoderKLCogVideoX.from_pretrained(path)
    vae.num_sample_frames_batch_size = vae.num_latent_frames_batch_size = 10 ** 6  # one process: the clip whole
    rng = np.random.default_rng(0)
    video = rng.uniform(-1, 1, (1, 3, frames) + tuple(size)).astype(np.float32)
    whole = vae.encode(video)
    start, end = cp.encode_shards(frames, n)[group.rank]
    part = cp.encode(vae, video[:, :, start:end], group)
    first, last = (start + 3) // 4, (end + 3) // 4  # its latent frames
    out = {"frames": [start, end], "latent": [first, last],
           "encode_mean": rel_err(part.mean.asnumpy(), whole.mean.asnumpy()[:, :, first:last]),
           "encode_logvar": rel_err(part.logvar.asnumpy(), whole.logvar.asnumpy()[:, :, first:last])}
    out["gathered"] = rel_err(cp.encode_gathered(vae, video, group).mean.asnumpy(), whole.mean.asnumpy())
    latents = rng.standard_normal(whole.mean.shape).astype(np.float32)
    decoded = vae.decode(latents).asnumpy()
    first, last = cp.decode_shards(latents.shape[2], n)[group.rank]
    pixels = cp.decoded_frames(first, last)
    got = cp.decode(vae, latents[:, :, first:last], group).asnumpy()
    out.update(decode_latent=[first, last], decode=rel_err(got, decoded[:, :, pixels[0]:pixels[1]]),
               decode_shape_equal=list(got.shape) == list(decoded[:, :, pixels[0]:pixels[1]].shape))
    wan_video = rng.uniform(-1, 1, (1, 3, frames) + tuple(wan_size or size)).astype(np.float32)
    out["wan"] = [_wan_case(p, wan_video, group) for p in wan_paths]
    return out


def _wan_case(path: str, video, group):
    """A Wan VAE's split encode (this rank's part, and gathered) against its chunked whole-clip encode."""
    from mm_models_video.wan import vae_context_parallel as cp
    from mm_models_video.wan.vae import AutoencoderKLWan

    vae = AutoencoderKLWan.from_pretrained(path)
    whole = vae.encode(video)
    start, end = cp.encode_shards(video.shape[2], group.size)[group.rank]
    part = cp.encode(vae, video[:, :, start:end], group)
    first, last = (start + 3) // 4, (end + 3) // 4
    return {"latent": [first, last],
            "encode_mean": rel_err(part.mean.asnumpy(), whole.mean.asnumpy()[:, :, first:last]),
            "encode_logvar": rel_err(part.logvar.asnumpy(), whole.logvar.asnumpy()[:, :, first:last]),
            "gathered": rel_err(cp.encode_gathered(vae, video, group).mean.asnumpy(), whole.mean.asnumpy())}
