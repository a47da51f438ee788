"""AutoencoderKLCogVideoX equals diffusers' on the same weights: encode (mean, logvar) and decode
over one and several frame batches (the causal caches and per-chunk GroupNorm carried as diffusers
does), a single frame, and save_pretrained folders diffusers loads unchanged."""

import diffusers  # noqa: F401  (the reference: required, see tests/conftest.py)
import numpy as np
import pytest
import torch
from helpers.torch_reference import assert_same_state, rel_err

# 3 blocks: spatial / 4 and time / 4 (both compressing blocks compress time), 4 groups
CONFIG = dict(in_channels=3, out_channels=3, block_out_channels=[8, 16, 16], latent_channels=4, layers_per_block=1,
              norm_num_groups=4, down_block_types=["CogVideoXDownBlock3D"] * 3,
              up_block_types=["CogVideoXUpBlock3D"] * 3, sample_height=32, sample_width=32)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from diffusers import AutoencoderKLCogVideoX as Reference

    torch.manual_seed(0)
    reference = Reference(**CONFIG).float().eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith("weight") and p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.8 / max(p[0].numel(), 1) ** 0.5 if p.ndim > 1 else 0.1))
    path = tmp_path_factory.mktemp("cogvideox_vae")
    reference.save_pretrained(str(path))
    return path, reference


@pytest.mark.parametrize("frames", [1, 9, 17, 21])  # 17, 21: two encode batches (21: 13 + 8)
def test_encode_equals_diffusers(folder, frames):
    from mm_models_video.cogvideox.vae import AutoencoderKLCogVideoX

    path, reference = folder
    video = np.random.default_rng(frames).uniform(-1, 1, (2, 3, frames, 16, 12)).astype(np.float32)
    with torch.no_grad():
        want = reference.encode(torch.from_numpy(video)).latent_dist
    got = AutoencoderKLCogVideoX.from_pretrained(path).encode(video)
    assert got.mean.shape == tuple(want.mean.shape) == (2, 4, 1 + (frames - 1) // 4, 4, 3)
    assert rel_err(got.mean.asnumpy(), want.mean.numpy()) <= 1e-5
    assert rel_err(got.logvar.asnumpy(), want.logvar.numpy()) <= 1e-5


@pytest.mark.parametrize("frames", [1, 2, 5])  # 5: decode batches of 3 and 2
def test_decode_equals_diffusers(folder, frames):
    from mm_models_video.cogvideox.vae import AutoencoderKLCogVideoX

    path, reference = folder
    latents = np.random.default_rng(frames).standard_normal((2, 4, frames, 4, 3)).astype(np.float32)
    with torch.no_grad():
        want = reference.decode(torch.from_numpy(latents)).sample.numpy()
    got = AutoencoderKLCogVideoX.from_pretrained(path).decode(latents).asnumpy()
    assert got.shape == want.shape
    assert rel_err(got, want) <= 1e-5


def test_save_pretrained_loads_in_diffusers(folder, tmp_path):
    from diffusers import AutoencoderKLCogVideoX as Reference

    from mm_models_video.cogvideox.vae import AutoencoderKLCogVideoX

    path, reference = folder
    AutoencoderKLCogVideoX.from_pretrained(path).save_pretrained(tmp_path)
    assert_same_state(Reference.from_pretrained(str(tmp_path)), reference)
    with pytest.raises(ValueError, match="unknown AutoencoderKLCogVideoX config keys"):
        AutoencoderKLCogVideoX({"block_out_channel": [8]})


@pytest.mark.parametrize("kind", ["encode", "decode"])
def test_tiled_encode_and_decode_equal_diffusers(folder, kind):
    """Tiles of 16 x 16 pixels (4 x 4 latents) over 32 x 28 frames: blended rows and columns."""
    from mm_models_video.cogvideox.vae import AutoencoderKLCogVideoX

    path, reference = folder
    reference.enable_tiling(tile_sample_min_height=16, tile_sample_min_width=16)
    ours = AutoencoderKLCogVideoX.from_pretrained(path)
    ours.enable_tiling(tile_sample_min_height=16, tile_sample_min_width=16)
    rng = np.random.default_rng(4)
    try:
        if kind == "encode":
            video = rng.uniform(-1, 1, (1, 3, 9, 32, 28)).astype(np.float32)
            with torch.no_grad():
                want = reference.encode(torch.from_numpy(video)).latent_dist.mean.numpy()
            got = ours.encode(video).mean.asnumpy()
        else:
            latents = rng.standard_normal((1, 4, 3, 10, 7)).astype(np.float32)
            with torch.no_grad():
                want = reference.decode(torch.from_numpy(latents)).sample.numpy()
            got = ours.decode(latents).asnumpy()
    finally:
        reference.disable_tiling()
    assert got.shape == want.shape
    assert rel_err(got, want) <= 1e-5


def test_whole_clip_batches_equal_diffusers_with_as_large_batches(folder):
    """num_sample_frames_batch_size / num_latent_frames_batch_size beyond the clip: one batch,
    GroupNorm over every frame (what vae_context_parallel splits over ranks), as diffusers."""
    from mm_models_video.cogvideox.vae import AutoencoderKLCogVideoX

    path, reference = folder
    ours = AutoencoderKLCogVideoX.from_pretrained(path)
    whole = {"num_sample_frames_batch_size": 64, "num_latent_frames_batch_size": 64}
    saved = {name: getattr(reference, name) for name in whole}
    video = np.random.default_rng(5).uniform(-1, 1, (1, 3, 21, 16, 12)).astype(np.float32)
    latents = np.random.default_rng(6).standard_normal((1, 4, 5, 4, 3)).astype(np.float32)
    try:
        for name, value in whole.items():
            setattr(reference, name, value)
            setattr(ours, name, value)
        with torch.no_grad():
            want = reference.encode(torch.from_numpy(video)).latent_dist
            decoded = reference.decode(torch.from_numpy(latents)).sample.numpy()
    finally:
        for name, value in saved.items():
            setattr(reference, name, value)
    got = ours.encode(video)
    assert rel_err(got.mean.asnumpy(), want.mean.numpy()) <= 1e-5
    assert rel_err(got.logvar.asnumpy(), want.logvar.numpy()) <= 1e-5
    assert rel_err(ours.decode(latents).asnumpy(), decoded) <= 1e-5
    chunked = AutoencoderKLCogVideoX.from_pretrained(path).encode(video).mean.asnumpy()
    assert rel_err(chunked, want.mean.numpy()) > 1e-3  # the batches of 8 normalise otherwise


@pytest.mark.parametrize("version, invert", [("1.0-i2v", False), ("1.5-i2v", False), ("1.5-i2v", True)])
def test_i2v_condition_equals_the_image_to_video_pipelines(folder, tmp_path, monkeypatch, version, invert):
    """The image condition (scaled image latents, zeros after, 1.5's front padding) equals what
    diffusers' CogVideoXImageToVideoPipeline.prepare_latents builds, the VAE's mode taken on both
    sides (the pipeline samples; training uses the mean)."""
    import diffusers.pipelines.cogvideo.pipeline_cogvideox_image2video as pipeline_module
    from diffusers import AutoencoderKLCogVideoX as Reference
    from diffusers import CogVideoXDDIMScheduler, CogVideoXTransformer3DModel
    from helpers.cogvideox_reference import CONFIGS

    from mm_models_video.cogvideox.conditioning import image_condition, image_latent_scale, pad_to_patch_frames
    from mm_models_video.cogvideox.vae import AutoencoderKLCogVideoX

    path, _ = folder
    reference = Reference.from_pretrained(path, scaling_factor=0.7, invert_scale_latents=invert).eval()
    reference.save_pretrained(str(tmp_path))
    transformer = CogVideoXTransformer3DModel(**CONFIGS[version])
    monkeypatch.setattr(pipeline_module, "retrieve_latents", lambda output, generator=None: output.latent_dist.mode())
    pipe = pipeline_module.CogVideoXImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=reference,
                                                         transformer=transformer, scheduler=CogVideoXDDIMScheduler())
    image = np.random.default_rng(3).uniform(-1, 1, (2, 3, 16, 12)).astype(np.float32)
    frames = 9  # 3 latent frames: 1.5 pads them to 4
    with torch.no_grad():
        noise = torch.zeros((2, 1, 4, 4, 3))
        _, want = pipe.prepare_latents(torch.from_numpy(image), 2, 4, frames, 16, 12, torch.float32, latents=noise)
    ours = AutoencoderKLCogVideoX.from_pretrained(tmp_path)
    latents = ours.encode(image[:, :, None]).mean.asnumpy() * image_latent_scale(ours.config)
    got = pad_to_patch_frames(image_condition(latents.transpose(0, 2, 1, 3, 4), 3), transformer.config.patch_size_t)
    assert got.shape == tuple(want.shape) == (2, 4 if version.startswith("1.5") else 3, 4, 4, 3)
    assert rel_err(got, want.numpy()) <= 1e-5
