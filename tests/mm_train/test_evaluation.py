"""Validation, samples and `mm-train generate`: the tiny Wan T2V recipe validates and samples every
10 steps (mp4s PyAV decodes, contact sheets, TensorBoard scalars and images read back with
TensorBoard's reader) and `generate` on its checkpoint draws the run's own sample, on one process
and with the model split under pp2 and cp2; `generate` on
a diffusers pipeline folder equals diffusers' WanPipeline on the same latents; a VL run validates
on a separate file and `generate` on its checkpoint gives the run's answer; the held-out split is
never trained on; bad eval settings are refused with what to change. The layouts' equality of
validation losses and samples is in families/video/test_wan / test_cogvideox / test_run / test_resume."""

import json
from pathlib import Path

import numpy as np
import pytest
from helpers.media import write_video
from helpers.mm_train_cli import rows_of, sample_pixels, val_losses
from helpers.train_runs import main_on_this_rank

pytestmark = pytest.mark.distributed

RECIPES = Path(__file__).resolve().parents[2] / "packages/mm-train/src/mm_train/recipes"
PROMPT = "a red square moving left on blue"


def decoded(path):
    import av

    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def test_wan_validates_and_samples_every_10_steps_and_generate_draws_the_same_clip(tmp_path, run_distributed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, data = tmp_path / "run", tmp_path / "tiny_video"
    main_on_this_rank(["run", "wan2_1_t2v_tiny", "--set", f"data.path={data}", "--set", f"output_dir={out}",
                       "--set", "train.steps=20", "--set", "eval.every=10", "--set", "eval.fraction=0.125",
                       "--set", "eval.sample_every=10", "--set", f"eval.prompts=[{PROMPT}, a green square]",
                       "--set", "eval.steps=3", "--set", "checkpoint.every=20", "--set", "logging.tensorboard=true",
                       "--no-progress"], {})
    rows = rows_of(out)
    assert list(val_losses(out)) == [10, 20] and all(np.isfinite(list(val_losses(out).values())))
    for step in (10, 20):
        folder = out / "samples" / f"step_{step}"
        assert {p.name for p in folder.iterdir()} == {"sample_0.mp4", "sample_0.png", "sample_1.mp4", "sample_1.png",
                                                      "prompts.txt"}
        assert decoded(folder / "sample_0.mp4").shape == (9, 32, 32, 3)  # the clips' 9 frames of 32 x 32
        assert rows[step - 1]["samples"][0] == f"samples/step_{step}/sample_0.mp4"
    assert (out / "loss.png").exists()
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/val_loss")] == \
        [(s, pytest.approx(v, rel=1e-6)) for s, v in val_losses(out).items()]
    assert [e.step for e in events.Images("samples/sample_1")] == [10, 20]

    for name, layout in (("one", []), ("pp2", ["parallel.pp=2"]), ("cp2", ["parallel.cp=2"])):
        clip = tmp_path / name / "clip.mp4"
        argv = ["generate", str(out / "checkpoints" / "step_20"), "--prompt", PROMPT, "--steps", "3", "--out",
                str(clip)]
        if layout:  # the model split over two ranks
            argv += [a for setting in layout for a in ("--set", setting)] + ["--nproc", "2"]
            run_distributed(main_on_this_rank, nproc=2, timeout=600, argv=argv, variables={})
        else:
            main_on_this_rank(argv, {})
        difference = np.abs(sample_pixels(out, 20) - np.asarray(_png(clip.with_suffix(".png")), int))
        assert difference.max() <= (0 if name == "one" else 1), name  # measured: equal under both layouts
    np.testing.assert_array_equal(decoded(tmp_path / "one" / "clip.mp4"),
                                  decoded(out / "samples" / "step_20" / "sample_0.mp4"))


def _png(path):
    from PIL import Image

    return Image.open(path)


def test_generate_from_a_diffusers_pipeline_folder_equals_diffusers_wan_pipeline(tmp_path):
    """The sampler behind `generate` and the eval samples — prompt encoding, flow-matching Euler
    with guidance, the VAE's denormalisation and decoding — equals diffusers' WanPipeline on the
    same folder and starting latents."""
    import torch
    from helpers.wan_pipelines import diffusers_pipeline, write_pipeline

    from mm_train import samples

    folder = write_pipeline(tmp_path / "pipeline")
    clip = tmp_path / "clip.mp4"
    flags = ["--frames", "9", "--height", "32", "--width", "32", "--steps", "4", "--guidance", "4.0", "--seed", "5"]
    main_on_this_rank(["generate", str(folder), "--prompt", PROMPT, "--out", str(clip), *flags], {})
    ours = np.asarray(_png(clip.with_suffix(".png")))
    # the noise generate starts from: (seed, prompt index), 4 latent channels x 3 frames x 4 x 4
    latents = np.random.default_rng([5, 0]).standard_normal((1, 4, 3, 4, 4)).astype(np.float32)
    pipe = diffusers_pipeline(folder)
    video = pipe(PROMPT, height=32, width=32, num_frames=9, num_inference_steps=4, guidance_scale=4.0,
                 latents=torch.from_numpy(latents), output_type="np").frames[0]  # (F, H, W, 3) in [0, 1]
    sheet = samples.contact_sheet(samples.to_frames(video.transpose(3, 0, 1, 2) * 2.0 - 1.0), scale=4)
    assert np.abs(ours.astype(int) - sheet.astype(int)).max() <= 1
    unguided = pipe(PROMPT, height=32, width=32, num_frames=9, num_inference_steps=4, guidance_scale=1.0,
                    latents=torch.from_numpy(latents), output_type="np").frames[0]
    other = samples.contact_sheet(samples.to_frames(unguided.transpose(3, 0, 1, 2) * 2.0 - 1.0), scale=4)
    assert np.abs(ours.astype(int) - other.astype(int)).mean() > 2  # the comparison sees the guidance


def _vl_file(root, data, count=8):
    """A LLaMA-Factory file of ``count`` pictures of the built-in set with their captions."""
    entries = json.loads((data / "data.json").read_text())[-count:]
    for entry in entries:
        entry["images"] = [str(data / image) for image in entry["images"]]
    (root / "held_out.json").write_text(json.dumps(entries))
    return root / "held_out.json"


def test_vl_validates_on_a_separate_file_and_answers_alike_in_the_run_and_under_every_layout(tmp_path,
                                                                                          run_distributed):
    """24 steps (enough for the tiny model to start a caption) validated on another file; the
    run's answer equals `generate` on its checkpoint on one process (the cached decoding) and
    under tp2, pp2, Ulysses cp2 and tp2 + sp (mm_parallel.decoding, the cache under each), and on the
    checkpoint converted to a Hugging Face folder."""
    from mm_train.families.vl.tiny import generate

    data = tmp_path / "data"
    generate(str(data), 32)
    held_out, out, home = _vl_file(tmp_path, data), tmp_path / "run", {"MM_TRAIN_DATA": str(data)}
    picture, clip = data / "images" / "00003.png", tmp_path / "clip.mp4"
    write_video(str(clip), 8, 56, 56, 4)
    main_on_this_rank(["run", "--set", f"output_dir={out}", "--set", "train.steps=24", "--set", "data.samples=32",
                       "--set", "eval.every=12", "--set", f"eval.path={held_out}", "--set", "eval.sample_every=24",
                       "--set", "eval.prompts=[<image>, 'what happens?']", "--set", f"eval.images=[{picture}, '']",
                       "--set", f"eval.videos=['', {clip}]", "--set", "eval.max_new_tokens=8", "--set",
                       "checkpoint.every=24", "--no-progress"], home)
    assert list(val_losses(out)) == [12, 24]
    page = (out / "samples" / "step_24" / "answers.md").read_text()
    assert "[clip.mp4](video_1.mp4)" in page and (out / "samples" / "step_24" / "video_1.mp4").exists()
    answers = {}
    for name, layout in (("one", []), ("tp2", ["parallel.tp=2"]), ("pp2", ["parallel.pp=2"]),
                         ("cp2", ["parallel.cp=2"]), ("tp2_sp", ["parallel.tp=2", "parallel.sequence_parallel=true"])):
        printed = tmp_path / f"{name}.txt"
        argv = ["generate", str(out / "checkpoints" / "step_24"), "--prompt", "<image>", "--image", str(picture),
                "--max-new-tokens", "8", "--out", str(printed)]
        argv += [a for setting in layout for a in ("--set", setting)] + (["--nproc", "2"] if layout else [])
        if layout:
            run_distributed(main_on_this_rank, nproc=2, timeout=600, argv=argv, variables=home)
        else:
            main_on_this_rank(argv, home)
        answers[name] = printed.read_text().strip()
    assert len(answers["one"].split()) >= 2 and f"> {answers['one']}" in page.splitlines(), (answers, page)
    assert set(answers.values()) == {answers["one"]}, answers
    # the checkpoint as a standalone Hugging Face folder (its tokenizer, chat template, processor configs)
    folder, printed = tmp_path / "hf", tmp_path / "hf.txt"
    main_on_this_rank(["convert", "checkpoint", str(out / "checkpoints" / "step_24"), str(folder)], home)
    main_on_this_rank(["generate", str(folder), "--prompt", "<image>", "--image", str(picture), "--max-new-tokens",
                       "8", "--out", str(printed)], home)
    assert printed.read_text().strip() == answers["one"]


def test_the_held_out_split_is_fixed_by_the_seed_and_never_trained_on():
    from mm_data import BucketBatchSampler, held_out_split

    train, held = held_out_split(100, 0.1, seed=7)
    assert len(held) == 10 and not set(train) & set(held) and len(train) + len(held) == 100
    assert np.array_equal(held_out_split(100, 0.1, seed=7)[1], held)
    assert not np.array_equal(held_out_split(100, 0.1, seed=8)[1], held)
    keys = [i % 2 for i in range(100)]
    for dp in (1, 2):
        sampler = BucketBatchSampler(100, 8, 0, dp, keys=keys, seed=3, indices=train)
        drawn = {int(i) for epoch in range(4) for batch in sampler.epoch_batches(epoch) for i in batch}
        assert drawn and not drawn & set(held.tolist())
        assert all(sampler.substitute(int(i), 0, 0) not in set(held.tolist()) for i in train[:20])
    with pytest.raises(ValueError, match="in \\(0, 1\\)"):
        held_out_split(10, 1.0, 0)


@pytest.mark.parametrize("overrides,message", [
    (["eval.every=5"], "eval.every needs a held-out split"),
    (["eval.sample_every=5"], "eval.sample_every needs eval.prompts"),
    (["eval.fraction=0.1", "eval.path=x.json"], "keep one"),
    (["eval.prompts=[a, b]", "eval.images=[x.png]", "eval.sample_every=2"], "one per prompt"),
    (["eval.every=2", "eval.fraction=0.2", "eval.batch_size=6"], "eval.batch_size=6 is not a multiple"),
    (["model.lora={r: 4, dropout: 0.05}"], "model.lora.dropout=0.05 is not supported yet"),
    (["eval.prompts=[what is it?]"], "not valid YAML .*quote text"),
])
def test_bad_eval_settings_are_refused_with_what_to_change(overrides, message):
    from mm_train.recipe import check_layout, load_recipe

    with pytest.raises(ValueError, match=message):
        check_layout(load_recipe("qwen2_5_vl_tiny", overrides), 1)


def test_bad_sample_requests_are_refused_with_what_to_change():
    from mm_train.families.video.samples import Settings
    from mm_train.families.vl.samples import prompt_inputs

    with pytest.raises(ValueError, match="2 <image> placeholders for 1 images: give one \\(--image / eval.images\\)"):
        prompt_inputs(None, (None, None), None, "<image> and <image>?", {"images": ["one.png"]}, None)
    with pytest.raises(ValueError, match="1 \\+ 4k"):
        Settings(num_frames=8, height=32, width=32)
    with pytest.raises(ValueError, match="use one of \\('ddim', 'dpm'\\)"):
        from mm_train.families.video.samples import CogVideoXSampler

        CogVideoXSampler.sampler_of(CogVideoXSampler.__new__(CogVideoXSampler),
                                    Settings(num_frames=9, height=32, width=32, sampler="euler"))
