"""`mm-train generate` for the video families: a clip from a prompt (and for I2V a first frame),
drawn by the sampler training samples with (mm_train.families.video.samples), so a checkpoint's
clip equals the run's sample of the same prompt, seed and settings."""

from __future__ import annotations

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


def generate_video(args, spec, folder, recipe, topo, chunks) -> Dict:
    """Write the clip as an mp4 at --out and a contact sheet beside it (rank 0); returns {"frames": ...}."""
    sampler_class = spec.task.clip_sampler
    config = chunks[0].config
    if recipe is not None:
        sampler = video_samples.recipe_sampler(sampler_class, recipe, topo, config)
    else:
        sampler = video_samples.pipeline_sampler(sampler_class, os.path.dirname(folder), config,
                                                 spec.sections["diffusion"])
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
