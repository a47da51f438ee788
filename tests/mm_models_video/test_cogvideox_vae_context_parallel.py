"""The CogVideoX VAE with a clip's frames split over 2 and 4 ranks (vae_context_parallel: causal
halos from the previous rank, GroupNorm statistics over the group) equals one process encoding
and decoding the whole clip: every rank's latents and frames, and the latents gathered on every
rank (encode_gathered, the feature cache's), rel-err <= 1e-5. One process on the
whole clip equals diffusers with its frame batches as large (test_cogvideox_vae.py)."""

import numpy as np
import pytest
from helpers.vae_context_parallel_cases import CONFIG, run_vae_cases

pytestmark = pytest.mark.distributed

FRAMES, SIZE = 33, (16, 12)  # 9 latent frames: 2 or 3 per rank on 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    import mindspore as ms

    from mm_models_video.cogvideox.vae import AutoencoderKLCogVideoX

    vae = AutoencoderKLCogVideoX(CONFIG)
    rng = np.random.default_rng(0)
    for p in vae.get_parameters():  # spread weights so every layer matters
        values = rng.standard_normal(p.shape).astype(np.float32)
        if p.ndim > 1:
            values *= 0.8 / np.prod(p.shape[1:]) ** 0.5
        p.set_data(ms.Tensor(1.0 + 0.2 * values if p.name.endswith("weight") and p.ndim == 1 else 0.1 * values
                             if p.ndim == 1 else values))
    path = tmp_path_factory.mktemp("cogvideox_vae_cp")
    vae.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("nproc", [2, 4])
def test_context_parallel_vae_equals_one_process_on_the_whole_clip(run_distributed, folder, nproc):
    results = run_distributed(run_vae_cases, nproc=nproc, timeout=600, path=folder, frames=FRAMES, size=SIZE)
    assert results[0]["frames"][0] == 0 and results[-1]["frames"][1] == FRAMES
    assert all(a["frames"][1] == b["frames"][0] for a, b in zip(results, results[1:]))  # the shards tile the clip
    assert results[-1]["decode_latent"][1] == results[-1]["latent"][1] == 9
    for rank, r in enumerate(results):
        assert r["latent"][1] - r["latent"][0] >= 2 and r["decode_shape_equal"], (rank, r)
        assert max(r["encode_mean"], r["encode_logvar"], r["decode"], r["gathered"]) <= 1e-5, (rank, r)
