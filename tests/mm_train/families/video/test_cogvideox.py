"""CogVideoX pre-training with `mm-train run`: the tiny recipes (built-in clips encoded once by a
tiny CogVideoX VAE and T5 into a feature cache, v-prediction) learn — 1.0 and 1.5, T2V and I2V
(the noise-augmented first frame's latents beside the noise, 1.5's padded frames and ofs) — and
give the same losses, validation losses and samples (DDIM; 1.5 I2V from a first frame with DPM)
on one process and under DP2, TP2+SP, PP2 and CP2 (ring and Ulysses, over the joint text + video
rows)."""

from pathlib import Path

import numpy as np
import pytest
from helpers.media import write_picture, write_user_clips
from helpers.mm_train_cli import losses, sample_pixels, val_losses
from helpers.train_runs import train

pytestmark = pytest.mark.distributed

RECIPES = Path(__file__).resolve().parents[4] / "packages/mm-train/src/mm_train/recipes"
RECIPE = str(RECIPES / "cogvideox_t2v_tiny.yaml")


# a held-out eighth validated every 2 steps, and at step 4 a sample (2 DDIM steps with guidance)
EVAL = ["--set", "eval.every=2", "--set", "eval.fraction=0.125", "--set", "eval.sample_every=4", "--set",
        "eval.prompts=[a red square moving left on blue]", "--set", "eval.steps=2"]


def same_evaluation(run, reference):
    """The run's validation losses and sample equal the reference run's."""
    assert val_losses(run) == pytest.approx(val_losses(reference), rel=1e-4), run.name
    assert list(val_losses(run)) == [2, 4]
    difference = np.abs(sample_pixels(run, 4) - sample_pixels(reference, 4))
    assert difference.max() <= 2 and difference.mean() < 0.05, (run.name, difference.max(), difference.mean())


def run(run_distributed, out, *extra, data, nproc=1, recipe=RECIPE, variables=None):
    train(run_distributed, recipe, "--set", f"data.path={data}", "--set", f"output_dir={out}", "--no-progress",
          *extra, nproc=nproc, data=out.parent / "unused", variables=variables)
    return losses(out)


def test_tiny_cogvideox_learns_and_trains_alike_under_every_layout(tmp_path, run_distributed):
    data = tmp_path / "tiny_video"
    learned = run(run_distributed, tmp_path / "long", "--set", "train.steps=16", data=data)
    assert sum(learned[-4:]) < 0.9 * sum(learned[:4]), learned  # seeded: the same run every time
    assert (data / "features-cogvideox-t2v").is_dir()  # its own cache beside Wan's
    four = ["--set", "train.steps=4", *EVAL]
    single = run(run_distributed, tmp_path / "single", *four, data=data)
    layouts = {"dp2": [], "tp2_sp": ["--set", "parallel.tp=2", "--set", "parallel.sequence_parallel=true"],
               "pp2": ["--set", "parallel.pp=2"],
               # ZeRO-3 cuts the weights over the cp ranks (they hold replicas)
               "cp2_ring_zero3": ["--set", "parallel.cp=2", "--set", "parallel.cp_algo=ring", "--set",
                                  "parallel.zero_stage=3", "--set", "parallel.zero3_min_numel=1024"]}
    for name, extra in layouts.items():
        got = run(run_distributed, tmp_path / name, *four, *extra, data=data, nproc=2)
        assert got == pytest.approx(single, rel=1e-4), (name, got, single)
        same_evaluation(tmp_path / name, tmp_path / "single")


def test_tiny_cogvideox_i2v_and_1_5_recipes_learn_and_i2v_trains_alike_under_tp_sp_and_ulysses(tmp_path,
                                                                                                run_distributed):
    data, sixteen = tmp_path / "tiny_video", ["--set", "train.steps=16"]
    for name in ("cogvideox_i2v_tiny", "cogvideox1_5_t2v_tiny", "cogvideox1_5_i2v_tiny"):
        learned = run(run_distributed, tmp_path / name, *sixteen, data=data, recipe=str(RECIPES / f"{name}.yaml"))
        assert sum(learned[-4:]) < 0.9 * sum(learned[:4]), (name, learned)
    assert (data / "features-cogvideox-i2v").is_dir()  # the image latents cached beside the clip's
    # 1.5 I2V samples from a first frame with the DPM sampler (1.5's frames padded in front, then dropped)
    first_frame = write_picture(tmp_path / "first_frame.png")
    i2v = str(RECIPES / "cogvideox1_5_i2v_tiny.yaml")
    four = ["--set", "train.steps=4", *EVAL, "--set", f"eval.images=[{first_frame}]", "--set", "eval.sampler=dpm"]
    single = run(run_distributed, tmp_path / "single", *four, data=data, recipe=i2v)
    assert sample_pixels(tmp_path / "single", 4).shape[1] == 9 * 128 + 8 * 2  # 9 frames of 32 x 4 a row
    layouts = {"tp2_sp": ["--set", "parallel.tp=2", "--set", "parallel.sequence_parallel=true"],
               "ulysses2": ["--set", "parallel.cp=2"]}
    for name, extra in layouts.items():
        got = run(run_distributed, tmp_path / name, *four, *extra, data=data, nproc=2, recipe=i2v)
        assert got == pytest.approx(single, rel=1e-4), (name, got, single)
        same_evaluation(tmp_path / name, tmp_path / "single")


def test_own_clips_cache_alike_with_the_vae_split_over_two_ranks(tmp_path, run_distributed):
    """data.vae / text_encoder: tiny write CogVideoX's tiny encoders as the folders diffusers and
    transformers load (bit for bit); one's own clips (13 frames: one VAE frame batch, so encoded
    whole either way) cached by one process and by two ranks splitting each clip's frames
    (data.vae_context_parallel=2, each encoding 2 of the 4 latent frames) hold the same latents."""
    import numpy as np
    import torch
    from diffusers import AutoencoderKLCogVideoX
    from transformers import T5EncoderModel

    from mm_data import FeatureDataset
    from mm_train.families.video import tiny as tiny_video

    user = write_user_clips(tmp_path) + ["--set", "data.vae=tiny", "--set", "data.text_encoder=tiny",
                                   "--set", "data.num_frames=13"]
    home = {"MM_TRAIN_VIDEO_DATA": str(tmp_path / "home")}
    one = run(run_distributed, tmp_path / "one", *user, data=tmp_path / "data.jsonl", variables=home)
    two = run(run_distributed, tmp_path / "two", *user, "--set", "data.vae_context_parallel=2", nproc=2,
              data=tmp_path / "data.jsonl", variables=home)
    assert np.isfinite(one + two).all()
    caches = [FeatureDataset(str(tmp_path / name / "features")) for name in ("one", "two")]
    assert len(caches[0]) == len(caches[1]) == 6  # the broken clip skipped by both
    # the two ranks encoded every clip together, the first of them wrote
    assert [p.name for p in (tmp_path / "two" / "features").glob("index-r*.jsonl")] == ["index-r000.jsonl"]
    by_index = [{e["index"]: c.get(i) for i, e in enumerate(c.entries)} for c in caches]
    for index, sample in by_index[0].items():
        got, want = by_index[1][index]["latents"], sample["latents"]
        assert got.shape == want.shape and got.shape[1] == 4
        assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want), index
    folders = tmp_path / "home" / "tiny_encoders-cogvideox"
    vae, text = tiny_video.cogvideox_encoders()
    for ours, theirs in ((vae, AutoencoderKLCogVideoX.from_pretrained(folders / "vae")),
                         (text, T5EncoderModel.from_pretrained(folders / "text_encoder"))):
        state = theirs.state_dict()
        for name, param in ours.parameters_and_names():
            assert torch.equal(state[name], torch.from_numpy(param.asnumpy())), name
