"""AutoencoderKLWan equals diffusers' on the same weights, in Wan2.1's layout and Wan2.2's
(TI2V-5B: residual blocks with AvgDown3D / DupUp3D shortcuts, 2 x 2 patchified frames, 16x
spatial compression): chunked causal encode of clips with 1 + 4k frames and odd latent sizes
(latent mean / logvar rel-err <= 1e-5), frame-by-frame decode back to 1 + 4k frames, spatial
tiling of both (diffusers' tiles and strides, scaled down), save_pretrained that diffusers
loads, latent normalisation with the config's mean / std."""

import diffusers  # noqa: F401  (the parity reference: required, see tests/conftest.py)
import numpy as np
import pytest
import torch
from helpers.torch_reference import assert_same_state, rel_err

MEAN, STD = [0.1, -0.2, 0.3, 0.0], [1.5, 2.0, 0.5, 1.0]
CONFIGS = {  # tiny widths: three downsamplings (the last two temporal), attention in the mid blocks
    "2.1": dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1),
    "2.2": dict(base_dim=8, decoder_base_dim=12, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                is_residual=True, patch_size=2, in_channels=12, out_channels=12, scale_factor_spatial=16),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def folder(request, tmp_path_factory):
    from diffusers import AutoencoderKLWan as Reference

    torch.manual_seed(0)
    reference = Reference(**CONFIGS[request.param], temperal_downsample=[False, True, True], latents_mean=MEAN,
                          latents_std=STD).eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "gamma" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 / max(p[0].numel(), 1) ** 0.5 if p.ndim > 1 else 0.1))
    path = tmp_path_factory.mktemp("wan_vae")
    reference.save_pretrained(path)
    return path, reference


def _compression(reference) -> int:
    return reference.config.scale_factor_spatial


def _check_round_trip(ours, reference, video):
    with torch.no_grad():
        posterior = reference.encode(torch.from_numpy(video)).latent_dist
        decoded = reference.decode(posterior.mean).sample.numpy()
    dist = ours.encode(video)
    s = _compression(reference)
    assert dist.mean.shape == (video.shape[0], 4, 1 + (video.shape[2] - 1) // 4, video.shape[3] // s,
                               video.shape[4] // s)
    assert rel_err(dist.mean.asnumpy(), posterior.mean.numpy()) <= 1e-5
    assert rel_err(dist.logvar.asnumpy(), posterior.logvar.numpy()) <= 1e-5
    ours_decoded = ours.decode(posterior.mean.numpy()).asnumpy()
    assert ours_decoded.shape == decoded.shape == video.shape
    assert rel_err(ours_decoded, decoded) <= 1e-5


@pytest.mark.parametrize("frames,latent_size", [(1, (2, 2)), (5, (2, 3)), (9, (3, 1))])
def test_encode_and_decode_equal_diffusers(folder, frames, latent_size):
    from mm_models_video import AutoencoderKLWan

    path, reference = folder
    size = tuple(n * _compression(reference) for n in latent_size)
    video = np.random.default_rng(frames).uniform(-1, 1, (2, 3, frames) + size).astype(np.float32)
    _check_round_trip(AutoencoderKLWan.from_pretrained(path), reference, video)


def test_tiled_encode_and_decode_equal_diffusers(folder):
    """Tiles of 4 x 4 latent pixels every 3 (diffusers' 256 / 192 at 1/4 scale in latents), on
    frames of 10 x 9 latent pixels: blends across both directions, cropped edges."""
    from mm_models_video import AutoencoderKLWan

    path, reference = folder
    s = _compression(reference)
    tile, stride = 4 * s, 3 * s
    ours = AutoencoderKLWan.from_pretrained(path)
    ours.enable_tiling(tile, tile, stride, stride)
    reference.enable_tiling(tile, tile, stride, stride)
    try:
        video = np.random.default_rng(3).uniform(-1, 1, (1, 3, 5, 10 * s, 9 * s)).astype(np.float32)
        _check_round_trip(ours, reference, video)
    finally:
        reference.use_tiling = False


def test_save_pretrained_writes_what_diffusers_loads(folder, tmp_path):
    from diffusers import AutoencoderKLWan as Reference

    from mm_models_video import AutoencoderKLWan

    path, reference = folder
    AutoencoderKLWan.from_pretrained(path).save_pretrained(tmp_path / "saved")
    loaded = Reference.from_pretrained(tmp_path / "saved")
    assert_same_state(loaded, reference)
    assert {k: v for k, v in loaded.config.items() if not k.startswith("_")} == \
        {k: v for k, v in reference.config.items() if not k.startswith("_")}


def test_latent_normalisation_round_trips(folder):
    from mm_models_video import AutoencoderKLWan

    path, reference = folder
    ours = AutoencoderKLWan.from_pretrained(path)
    s = _compression(reference)
    normalised = ours.normalize_latents(ours.encode(np.zeros((1, 3, 1, s, s), np.float32)).mean).asnumpy()
    assert normalised.shape == (1, 4, 1, 1, 1)
    import mindspore as ms

    latents = np.random.default_rng(0).standard_normal((1, 4, 2, 3, 3)).astype(np.float32)
    z = ms.Tensor(latents)
    mean, std = (np.array(v, np.float32).reshape(1, 4, 1, 1, 1) for v in (MEAN, STD))
    np.testing.assert_allclose(ours.normalize_latents(z).asnumpy(), (latents - mean) / std, rtol=1e-6)
    np.testing.assert_allclose(ours.denormalize_latents(ours.normalize_latents(z)).asnumpy(), latents, rtol=1e-5,
                               atol=1e-6)


def test_bad_configs_and_sizes_are_refused():
    from mm_models_video import AutoencoderKLWan

    with pytest.raises(ValueError, match="unknown"):
        AutoencoderKLWan({"base_dims": 8})
    vae = AutoencoderKLWan(CONFIGS["2.2"])
    with pytest.raises(ValueError, match="divisible by 2"):
        vae.encode(np.zeros((1, 3, 1, 16, 15), np.float32))
