"""The video VAEs with a clip's frames split over 2 and 4 ranks (vae_context_parallel: causal
halos from the previous rank; CogVideoX's GroupNorm statistics over the group) equal one process
encoding (and, CogVideoX, decoding) the whole clip: every rank's latents and frames, and the
latents gathered on every rank (encode_gathered, the feature cache's), rel-err <= 1e-5. CogVideoX,
the Wan2.1 VAE and the Wan2.2 (TI2V-5B) VAE in one launch. One process on the whole clip equals
diffusers (CogVideoX with its frame batches as large: test_cogvideox_vae.py; test_wan_vae.py)."""

import numpy as np
import pytest
from helpers.vae_context_parallel_cases import CONFIG, run_vae_cases

pytestmark = pytest.mark.distributed

FRAMES, SIZE = 33, (16, 12)  # 9 latent frames: 2 or 3 per rank on 4
WAN_SIZE = (16, 32)  # Wan2.2's 16x compression: 1 x 2 latent pixels


WAN_CONFIGS = {  # Wan2.1's layout, and Wan2.2's (residual blocks, 2 x 2 patches) at tiny widths
    "wan2_1": dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1),
    "wan2_2": dict(base_dim=8, decoder_base_dim=12, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                   is_residual=True, patch_size=2, in_channels=12, out_channels=12, scale_factor_spatial=16),
}


def _spread_and_save(vae, path):
    import mindspore as ms

    rng = np.random.default_rng(0)
    for p in vae.get_parameters():  # spread weights so every layer matters
        values = rng.standard_normal(p.shape).astype(np.float32)
        if p.ndim > 1:
            values *= 0.8 / np.prod(p.shape[1:]) ** 0.5
        scale_like = (p.name.endswith("weight") and p.ndim == 1) or "gamma" in p.name
        p.set_data(ms.Tensor(1.0 + 0.2 * values if scale_like else 0.1 * values if p.ndim == 1 else values))
    vae.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from mm_models_video.cogvideox.vae import AutoencoderKLCogVideoX

    return _spread_and_save(AutoencoderKLCogVideoX(CONFIG), tmp_path_factory.mktemp("cogvideox_vae_cp"))


@pytest.fixture(scope="module")
def wan_folders(tmp_path_factory):
    from mm_models_video.wan.vae import AutoencoderKLWan

    return [_spread_and_save(AutoencoderKLWan(config), tmp_path_factory.mktemp(name))
            for name, config in WAN_CONFIGS.items()]


@pytest.mark.parametrize("nproc", [2, 4])
def test_context_parallel_vae_equals_one_process_on_the_whole_clip(run_distributed, folder, wan_folders, nproc):
    results = run_distributed(run_vae_cases, nproc=nproc, timeout=600, path=folder, frames=FRAMES, size=SIZE,
                              wan_paths=wan_folders, wan_size=WAN_SIZE)
    assert results[0]["frames"][0] == 0 and results[-1]["frames"][1] == FRAMES
    assert all(a["frames"][1] == b["frames"][0] for a, b in zip(results, results[1:]))  # the shards tile the clip
    assert results[-1]["decode_latent"][1] == results[-1]["latent"][1] == 9
    for rank, r in enumerate(results):
        assert r["latent"][1] - r["latent"][0] >= 2 and r["decode_shape_equal"], (rank, r)
        assert max(r["encode_mean"], r["encode_logvar"], r["decode"], r["gathered"]) <= 1e-5, (rank, r)
    for rank, r in enumerate(results):
        assert len(r["wan"]) == 2
        for name, wan in zip(WAN_CONFIGS, r["wan"]):
            assert wan["latent"] == r["latent"], (name, rank)
            assert max(wan["encode_mean"], wan["encode_logvar"], wan["gathered"]) <= 1e-5, (name, rank, wan)
