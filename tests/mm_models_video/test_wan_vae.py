"""AutoencoderKLWan equals diffusers' on the same weights: chunked causal encode of clips with
1 + 4k frames (latent mean / logvar rel-err <= 1e-5), frame-by-frame decode back to 1 + 4k frames,
latent normalisation with the config's mean / std."""

import diffusers  # noqa: F401  (the parity reference: required, see tests/conftest.py)
import numpy as np
import pytest
import torch
from helpers.torch_reference import assert_same_state, rel_err

MEAN, STD = [0.1, -0.2, 0.3, 0.0], [1.5, 2.0, 0.5, 1.0]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from diffusers import AutoencoderKLWan as Reference

    torch.manual_seed(0)
    # tiny Wan2.1 layout: three downsamplings (the last two temporal), attention in the mid blocks
    reference = Reference(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                          temperal_downsample=[False, True, True], latents_mean=MEAN, latents_std=STD).eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if "gamma" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 / max(p[0].numel(), 1) ** 0.5 if p.ndim > 1 else 0.1))
    path = tmp_path_factory.mktemp("wan_vae")
    reference.save_pretrained(path)
    return path, reference


@pytest.mark.parametrize("frames,size", [(1, (16, 16)), (5, (16, 24)), (9, (24, 16))])
def test_encode_and_decode_equal_diffusers(folder, frames, size):
    from mm_models_video import AutoencoderKLWan

    path, reference = folder
    ours = AutoencoderKLWan.from_pretrained(path)
    video = np.random.default_rng(frames).uniform(-1, 1, (2, 3, frames) + size).astype(np.float32)
    with torch.no_grad():
        posterior = reference.encode(torch.from_numpy(video)).latent_dist
        decoded = reference.decode(posterior.mean).sample.numpy()
    dist = ours.encode(video)
    assert dist.mean.shape == (2, 4, 1 + (frames - 1) // 4, size[0] // 8, size[1] // 8)
    assert rel_err(dist.mean.asnumpy(), posterior.mean.numpy()) <= 1e-5
    assert rel_err(dist.logvar.asnumpy(), posterior.logvar.numpy()) <= 1e-5
    ours_decoded = ours.decode(posterior.mean.numpy()).asnumpy()
    assert ours_decoded.shape == decoded.shape == video.shape
    assert rel_err(ours_decoded, decoded) <= 1e-5


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

    ours = AutoencoderKLWan.from_pretrained(folder[0])
    latents = np.random.default_rng(0).standard_normal((1, 4, 2, 3, 3)).astype(np.float32)
    normalised = ours.normalize_latents(ours.encode(np.zeros((1, 3, 1, 8, 8), np.float32)).mean).asnumpy()
    assert normalised.shape == (1, 4, 1, 1, 1)
    import mindspore as ms

    z = ms.Tensor(latents)
    mean, std = (np.array(v, np.float32).reshape(1, 4, 1, 1, 1) for v in (MEAN, STD))
    expected = (latents - mean) / std
    np.testing.assert_allclose(ours.normalize_latents(z).asnumpy(), expected, rtol=1e-6)
    np.testing.assert_allclose(ours.denormalize_latents(ours.normalize_latents(z)).asnumpy(), latents, rtol=1e-5,
                               atol=1e-6)


def test_wan22_layouts_are_refused():
    from mm_models_video import AutoencoderKLWan

    with pytest.raises(ValueError, match="Wan2.2"):
        AutoencoderKLWan({"is_residual": True})
    with pytest.raises(ValueError, match="unknown"):
        AutoencoderKLWan({"base_dims": 8})
