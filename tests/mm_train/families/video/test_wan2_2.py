"""Wan2.2 with `mm-train run` and `mm-train generate`: TI2V (text- and text+image-to-video samples in
one run, per-token timesteps, the tiny set encoded by a VAE of Wan2.2's layout) and A14B's pair
of experts switched by noise level — the same losses under a layout as on one process (with
model.expert both, data-parallel ranks whose micro-batches chose different experts), checkpoints
in the hub's layout resumed under another layout, single-expert runs on their range of
timesteps; `generate` on Wan2.2 pipeline folders equals diffusers' pipelines (transformer_2 and
boundary_ratio; expand_timesteps, with and without an image) within one grey level."""

import json
from pathlib import Path

import numpy as np
import pytest
from helpers.media import write_picture
from helpers.mm_train_cli import losses, sample_pixels, val_losses
from helpers.train_runs import main_on_this_rank, train

pytestmark = pytest.mark.distributed

RECIPES = Path(__file__).resolve().parents[4] / "packages/mm-train/src/mm_train/recipes"
TI2V, A14B = str(RECIPES / "wan2_2_ti2v_tiny.yaml"), str(RECIPES / "wan2_2_a14b_tiny.yaml")
PROMPT = "a red square moving left on blue"


def run(run_distributed, recipe, out, *extra, data, nproc=1):
    train(run_distributed, recipe, "--set", f"data.path={data}", "--set", f"output_dir={out}", "--no-progress",
          *extra, nproc=nproc, data=out.parent / "unused")
    return losses(out)


def test_ti2v_trains_text_and_image_to_video_alike_under_tp2_sp(tmp_path, run_distributed):
    """The TI2V recipe: its cache encoded by the Wan2.2-layout VAE (z 8); half the samples keep
    their first frame; losses, validation losses and samples (one from a first frame, one from text)
    equal on one process and under tp2 + sp (the per-token timesteps cut with the tokens)."""
    first = write_picture(tmp_path / "first_frame.png")
    data = tmp_path / "tiny_video"
    four = ["--set", "train.steps=4", "--set", "eval.every=2", "--set", "eval.fraction=0.125", "--set",
            "eval.sample_every=4", "--set", f"eval.prompts=[{PROMPT}, {PROMPT}]", "--set",
            f"eval.images=[{first}, '']", "--set", "eval.steps=2"]
    single = run(run_distributed, TI2V, tmp_path / "single", *four, data=data)
    entry = json.loads((data / "features-wan2_2-t2v" / "index-r000.jsonl").read_text().splitlines()[0])
    assert entry["features"]["latents"][0] == 8  # z 8: Wan2.2's tiny VAE, not Wan2.1's (z 4)
    layout = ["--set", "parallel.tp=2", "--set", "parallel.sequence_parallel=true"]
    got = run(run_distributed, TI2V, tmp_path / "tp2_sp", *four, *layout, data=data, nproc=2)
    assert got == pytest.approx(single, rel=1e-4)
    assert val_losses(tmp_path / "tp2_sp") == pytest.approx(val_losses(tmp_path / "single"), rel=1e-4)
    sheets = {name: [sample_pixels(tmp_path / name, 4, f"sample_{i}.png") for i in (0, 1)] for name in ("single",
                                                                                                   "tp2_sp")}
    for one, other in zip(sheets["single"], sheets["tp2_sp"]):
        difference = np.abs(one - other)
        assert difference.max() <= 2 and difference.mean() < 0.05, difference.max()
    assert np.abs(sheets["single"][0] - sheets["single"][1]).mean() > 1  # the first frame changes the sample


def _expert_draws(steps: int, global_batch: int, micro: int, dp: int):
    """Which expert each rank's micro-batches drew at each step (high: True), as the data does it
    (wan_pipeline.WanPipelineSettings.micro_batch_range on the sampler's batches)."""
    from mm_data import BucketBatchSampler
    from mm_models_video.flow_matching import FlowMatchingSchedule
    from mm_train.families.video.wan_pipeline import WanPipelineSettings

    settings, schedule = WanPipelineSettings(boundary_ratio=0.875, expert="both"), FlowMatchingSchedule(1000, 5.0)
    high = schedule.expert_u_ranges(875)[0]
    batches = BucketBatchSampler(64, global_batch, seed=0).epoch_batches(0)
    draws = []
    for step in range(steps):
        ranks = [BucketBatchSampler(64, global_batch, r, dp, seed=0).local(batches[step]) for r in range(dp)]
        draws.append([[settings.micro_batch_range(schedule, "uniform", 0, step, int(share[i])) == high
                       for i in range(0, len(share), micro)] for share in ranks])
    return draws


def test_a14b_both_experts_equal_one_process_under_dp2_and_resume_under_pp2(tmp_path, run_distributed):
    """model.expert both: each micro-batch draws its expert; under dp2 a rank whose micro-batches
    all chose one expert still reduces the other's (zero) gradients with the rank that used it —
    losses over 6 steps equal one process's; a checkpoint (transformer/ and transformer_2/ beside a
    model_index.json with the boundary) written under pp2 resumes on one process."""
    data = tmp_path / "tiny_video"
    six = ["--set", "train.steps=6", "--set", "train.global_batch_size=4", "--set", "train.micro_batch_size=2"]
    draws = _expert_draws(6, 4, 2, 2)
    assert any(ranks[0] != ranks[1] for ranks in draws), draws  # some step the ranks used different experts
    single = run(run_distributed, A14B, tmp_path / "single", *six, data=data)
    dp2 = run(run_distributed, A14B, tmp_path / "dp2", *six, data=data, nproc=2)
    assert dp2 == pytest.approx(single, rel=1e-4)
    every = ["--set", "checkpoint.every=3"]
    run(run_distributed, A14B, tmp_path / "resumed", *six, "--set", "train.steps=3", "--set", "parallel.pp=2", *every,
        data=data, nproc=2)
    model = tmp_path / "resumed" / "checkpoints" / "step_3" / "model"
    index = json.loads((model / "model_index.json").read_text())
    assert index["boundary_ratio"] == 0.875 and (model / "transformer_2" / "config.json").is_file()
    resumed = run(run_distributed, A14B, tmp_path / "resumed", *six, *every, "--resume", data=data)
    assert resumed == pytest.approx(single, rel=1e-4)
    _generate_equals_diffusers(tmp_path / "resumed" / "checkpoints" / "step_6", data, tmp_path)


def _generate_equals_diffusers(step, data, tmp_path):
    """`mm-train generate` on an A14B checkpoint and diffusers' WanPipeline of its two experts,
    the run's tiny encoders (as folders) and tokenizer, the recipe's shift and prompt length, on
    the same starting latents: within one grey level."""
    import torch
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from PIL import Image
    from transformers import UMT5EncoderModel

    from mm_train import samples
    from mm_train.families.video import tiny as tiny_video

    clip = tmp_path / "clip.mp4"
    main_on_this_rank(["generate", str(step), "--prompt", PROMPT, "--out", str(clip), "--frames", "9", "--height", "32",
                       "--width", "32", "--steps", "3", "--guidance", "4.0", "--seed", "2"], {})
    folders = tiny_video.encoder_folders(str(tmp_path / "encoders"))  # the same seeded weights as the run's
    model = step / "model"
    pipe = WanPipeline(tokenizer=tiny_video.tokenizer(str(data)),
                       text_encoder=UMT5EncoderModel.from_pretrained(folders["text_encoder"]),
                       vae=AutoencoderKLWan.from_pretrained(folders["vae"]),
                       transformer=WanTransformer3DModel.from_pretrained(model / "transformer"),
                       transformer_2=WanTransformer3DModel.from_pretrained(model / "transformer_2"),
                       boundary_ratio=0.875, scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0))
    latents = np.random.default_rng([2, 0]).standard_normal((1, 4, 3, 4, 4)).astype(np.float32)
    video = pipe(PROMPT, height=32, width=32, num_frames=9, num_inference_steps=3, guidance_scale=4.0,
                 max_sequence_length=16, latents=torch.from_numpy(latents), output_type="np").frames[0]
    sheet = samples.contact_sheet(samples.to_frames(video.transpose(3, 0, 1, 2) * 2.0 - 1.0), scale=4)
    assert np.abs(np.asarray(Image.open(clip.with_suffix(".png")), int) - sheet.astype(int)).max() <= 1


def test_one_expert_trains_on_its_timesteps_and_refuses_what_cannot_work(tmp_path, run_distributed):
    """model.expert high_noise holds only transformer/ and draws every timestep at or above the
    boundary (checked on the micro-batches the data makes); an I2V-A14B-style pair (the image's
    latents and mask beside the noise, no CLIP) caches and trains without image features; both
    under ZeRO-3 is refused before launch with what to do."""
    from mm_train.recipe import load_recipe

    data = tmp_path / "tiny_video"
    out = tmp_path / "high"
    run(run_distributed, A14B, out, "--set", "model.expert=high_noise", "--set", "train.steps=2", "--set",
        "checkpoint.every=2", data=data)
    model = out / "checkpoints" / "step_2" / "model"
    assert (model / "transformer").is_dir() and not (model / "transformer_2").exists()
    import mm_parallel
    from mm_train.families.video.wan import WanTask

    recipe = load_recipe(A14B, [f"data.path={data}", "model.expert=high_noise", f"output_dir={tmp_path / 'x'}"])
    task = WanTask(recipe, mm_parallel.initialize(mm_parallel.ParallelConfig()))
    batches = next(task.stream(0))
    assert all(np.min(b["timestep"]) >= 875 for b in batches)
    run(run_distributed, A14B, tmp_path / "i2v", "--set", "model.config.in_channels=12", "--set", "train.steps=2",
        data=data)
    entry = json.loads((data / "features-i2v-latents" / "index-r000.jsonl").read_text().splitlines()[0])
    assert set(entry["features"]) == {"latents", "prompt_embeds", "condition"}
    with pytest.raises(RuntimeError, match="eval.prompts: samples cross the experts' boundary and this run trains "
                                           "transformer alone; set model.path to the Wan2.2 folder that also holds"):
        main_on_this_rank(["run", A14B, "--set", f"data.path={data}", "--set", "model.expert=high_noise", "--set",
                           "eval.prompts=[a square]", "--set", f"output_dir={tmp_path / 'samples'}"], {})
    with pytest.raises(RuntimeError, match="model.expert both with parallel.zero_stage 3: .* train one expert per run"):
        main_on_this_rank(["run", A14B, "--set", f"data.path={data}", "--set", "parallel.zero_stage=3", "--set",
                           f"output_dir={tmp_path / 'zero3'}", "--nproc", "2"], {})


@pytest.mark.parametrize("kind, image", [("a14b", False), ("ti2v", False), ("ti2v", True)])
def test_generate_on_a_wan2_2_folder_equals_diffusers_pipelines(tmp_path, kind, image):
    """`mm-train generate` on a Wan2.2 pipeline folder and diffusers' WanPipeline /
    WanImageToVideoPipeline (transformer_2 and boundary_ratio; expand_timesteps) on the same
    starting latents: within one grey level."""
    import torch
    from helpers.wan_pipelines import diffusers_pipeline, write_pipeline
    from PIL import Image

    from mm_train import samples

    folder = write_pipeline(tmp_path / "pipeline", kind)
    clip, first = tmp_path / "clip.mp4", write_picture(tmp_path / "first_frame.png")
    flags = ["--frames", "9", "--height", "32", "--width", "32", "--steps", "4", "--guidance", "4.0", "--seed", "5"]
    main_on_this_rank(["generate", str(folder), "--prompt", PROMPT, "--out", str(clip), *flags,
                       *(["--image", str(first)] if image else [])], {})
    ours = np.asarray(Image.open(clip.with_suffix(".png")), int)
    channels = 8 if kind == "ti2v" else 4
    latents = np.random.default_rng([5, 0]).standard_normal((1, channels, 3, 4, 4)).astype(np.float32)
    text = {"prompt": PROMPT}
    if image:  # the I2V pipeline's prompt cleaning needs ftfy: its text as WanPipeline encodes it instead
        embeds = diffusers_pipeline(folder).encode_prompt(PROMPT, negative_prompt="", do_classifier_free_guidance=True,
                                                          max_sequence_length=512)
        text = {"prompt_embeds": embeds[0], "negative_prompt_embeds": embeds[1],
                "image": Image.open(first).convert("RGB")}
    video = diffusers_pipeline(folder, image)(height=32, width=32, num_frames=9, num_inference_steps=4,
                                              guidance_scale=4.0, latents=torch.from_numpy(latents), output_type="np",
                                              **text).frames[0]
    sheet = samples.contact_sheet(samples.to_frames(video.transpose(3, 0, 1, 2) * 2.0 - 1.0), scale=4)
    assert np.abs(ours - sheet.astype(int)).max() <= 1


def test_lora_on_both_experts_writes_peft_adapters_and_converts_to_the_hub_layout(tmp_path, run_distributed):
    """LoRA on A14B's pair: adapters/transformer and adapters/transformer_2 in PEFT's format; `mm-train
    convert checkpoint` merges each into its expert (W + alpha / r B A from the adapter files), a
    folder diffusers' WanPipeline loads with the boundary."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
    from safetensors.numpy import load_file

    out = tmp_path / "lora"
    run(run_distributed, A14B, out, "--set", "model.lora.r=4", "--set", "model.lora.alpha=8", "--set",
        "train.steps=2", "--set", "checkpoint.every=2", data=tmp_path / "tiny_video")
    step, exported = out / "checkpoints" / "step_2", tmp_path / "exported"
    main_on_this_rank(["convert", "checkpoint", str(step), str(exported)], {})
    pipe = WanPipeline.from_pretrained(str(exported), vae=None, text_encoder=None, tokenizer=None,
                                       scheduler=FlowMatchEulerDiscreteScheduler())
    assert pipe.config.boundary_ratio == 0.875
    for name in ("transformer", "transformer_2"):
        config = json.loads((step / "adapters" / name / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA" and config["r"] == 4
        adapters = load_file(str(step / "adapters" / name / "adapter_model.safetensors"))
        base = load_file(str(step / "model" / name / "diffusion_pytorch_model.safetensors"))
        merged = {k: v.numpy() for k, v in getattr(pipe, name).state_dict().items()}
        keys = [k[len("base_model.model."):-len(".lora_A.weight")] for k in adapters if k.endswith("lora_A.weight")]
        assert keys and all(k.startswith("blocks.") for k in keys)
        for module in keys:
            a, b = (adapters[f"base_model.model.{module}.lora_{x}.weight"] for x in "AB")
            want = base[f"{module}.weight"] + 2.0 * (b @ a)
            np.testing.assert_allclose(merged[f"{module}.weight"], want, rtol=1e-5, atol=1e-6, err_msg=module)
        assert not np.allclose(b, 0), name  # the run trained the adapters (B starts at zero)
        assert torch.is_tensor(getattr(pipe, name).proj_out.weight)
