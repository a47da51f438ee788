"""`mm-train generate` for the video families: a clip from a prompt (and for I2V a first frame),
drawn by the sampler training samples with (mm_train.families.video.samples), so a checkpoint's
clip equals the run's sample of the same prompt, seed and settings."""

from __future__ import annotations

import json
import os
import sys
from typing import Dict

from mm_train import samples
from mm_train.families.video import samples as video_samples


def video_settings(args, sampler_class, recipe):
    base = video_samples.recipe_settings(recipe) if recipe is not None else \
        video_samples.Settings(**{k: v for k, v in sampler_class.defaults.items()})
    given = dict(num_frames=args.frames, height=args.height, width=args.width, steps=args.steps,
                 guidance=args.guidance, sampler=args.sampler, negative_prompt=args.negative_prompt)
    values = {**base.__dict__, **{k: v for k, v in given.items() if v is not None}, "seed": args.seed}
    return video_samples.Settings(**values)


def _expand_timesteps(folder: str, recipe) -> bool:
    """Whether a checkpoint's model takes per-token timesteps (TI2V): the recipe's diffusion
    section says, else its model_index.json."""
    given = getattr(recipe.section("diffusion"), "expand_timesteps", None)
    index = os.path.join(folder, "model_index.json")
    if given is None and os.path.isfile(index):
        with open(index) as f:
            given = json.load(f).get("expand_timesteps")
    return bool(given)


def generate_video(args, spec, folder, recipe, topo, chunks) -> Dict:
    """Write the clip as an mp4 at --out and a contact sheet beside it (rank 0); returns {"frames": ...}."""
    sampler_class = spec.task.clip_sampler
    config = chunks[0].config
    if recipe is not None:
        spec.task.prepare_sampling(chunks, recipe)
        sampler = video_samples.recipe_sampler(sampler_class, recipe, topo, config, _expand_timesteps(folder, recipe))
    else:  # the pipeline folder itself (a model that reads it whole) or its denoiser's sub-folder
        root = folder if os.path.isfile(os.path.join(folder, "model_index.json")) else os.path.dirname(folder)
        sampler = video_samples.pipeline_sampler(sampler_class, root, config, spec.sections["diffusion"])
    settings = video_settings(args, sampler_class, recipe)
    if not args.out:
        raise ValueError("a video model writes an mp4: give --out FILE.mp4")
    with samples.inference(chunks):
        frames = video_samples.clip(sampler, lambda inputs, shape: samples.predict(chunks, topo, inputs, shape),
                                    args.prompt, args.image, settings)
    if topo.rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        samples.write_mp4(args.out, frames, settings.fps)
        sheet = os.path.splitext(args.out)[0] + ".png"
        samples.write_png(sheet, samples.contact_sheet(frames, scale=max(1, 128 // max(frames.shape[1:3]))))
        print(f"mm-train: {frames.shape[0]} frames of {frames.shape[2]} x {frames.shape[1]} in {args.out} "
              f"(contact sheet {sheet})", file=sys.stderr)
    return {"frames": frames}
