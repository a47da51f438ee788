"""`mm-train generate`: what a trained model makes of a prompt, from the command line.

    mm-train generate SOURCE --prompt TEXT [--image FILE | --video FILE | --audio FILE] --out FILE
                      [--frames N --height H --width W --steps S --guidance G --sampler NAME
                       --negative-prompt TEXT --seed X] [--max-new-tokens N]
                      [--nproc N --set parallel.tp=2 ...]

SOURCE is one of
- a training checkpoint (OUT/checkpoints/step_N): its recipe.json names the family, the encoders
  (or the tiny ones), the tokenizer and processors, the diffusion settings; LoRA adapters are
  applied; sizes, steps and guidance default to the recipe's eval section and training clips;
- a diffusers pipeline folder (model_index.json with transformer/, vae/, text_encoder/,
  tokenizer/ [, image_encoder/, image_processor/] and scheduler/ whose config gives the shift /
  the SNR settings); sizes, steps and guidance default to the pipeline's own call defaults;
- a Hugging Face VL folder (config.json, its tokenizer and preprocessor_config.json).

Video models write the clip as an mp4 at --out and its frames as a contact sheet beside it
(.png); the sampler is the one training samples with (the family's ``generate``), so a checkpoint's
clip equals the run's sample of the same prompt, seed and settings. VL models print the greedy
answer and write it to --out. ``--nproc N`` starts msrun (N local workers) with the layout the
``--set parallel.*`` values give (default: one process holds the whole model).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, Optional, Tuple

from mm_train import registry
from mm_train.recipe import build_recipe, parse_override
from mm_train.task import plan_options
from mm_train.worker_output import LogRelay, report_failure

# Deferred imports: MindSpore and mm-parallel (the CLI starts without loading MindSpore).


def add_parser(commands) -> None:
    p = commands.add_parser("generate", help="a video or an answer from a checkpoint or a Hugging Face folder",
                            description="Sample a video (text / image to video) or answer a prompt (VL) with a "
                                        "training checkpoint, a diffusers pipeline folder or a Hugging Face folder.")
    p.add_argument("source", help="OUT/checkpoints/step_N, a diffusers pipeline folder or a Hugging Face folder")
    p.add_argument("--prompt", required=True)
    p.add_argument("--image", help="the first frame (image to video) or the picture the prompt asks about")
    p.add_argument("--video", help="VL: the clip the prompt asks about")
    p.add_argument("--audio", help="models that hear: the sound the prompt asks about")
    p.add_argument("--out", help="the mp4 to write (video); the answer's text file (VL, optional)")
    p.add_argument("--frames", type=int, help="frames of the clip (1 + 4k)")
    p.add_argument("--height", type=int)
    p.add_argument("--width", type=int)
    p.add_argument("--steps", type=int, help="sampler steps")
    p.add_argument("--guidance", type=float, help="classifier-free guidance scale")
    p.add_argument("--sampler", help="one of the family's samplers (default its first; a wrong name lists them)")
    p.add_argument("--negative-prompt", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=64, help="VL: the answer's length limit")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="parallel.KEY=VALUE",
                   help="the layout, e.g. --set parallel.tp=2 (repeatable)")
    p.add_argument("--nproc", type=int, default=1, help="local processes; > 1 starts msrun (default 1)")
    p.add_argument("--timeout", type=float, default=3600.0, help="with --nproc > 1: stop the workers after this long")


# -- where the model and its companions are ---------------------------------------------------


def _checkpoint_recipe(folder: str, overrides):
    """The recipe a checkpoint recorded, its layout replaced by the one ``overrides`` give."""
    with open(os.path.join(folder, "recipe.json")) as f:
        values = json.load(f)
    values["parallel"] = _layout(overrides)
    return build_recipe(values)


def resolve_source(source: str, overrides) -> Tuple[registry.FamilySpec, str, Optional[object]]:
    """(the family, the model folder, the checkpoint's recipe or None) of SOURCE."""
    if os.path.isfile(os.path.join(source, "recipe.json")) and os.path.isdir(os.path.join(source, "model")):
        recipe = _checkpoint_recipe(source, overrides)
        return recipe.family, os.path.join(source, "model"), recipe
    if os.path.isfile(os.path.join(source, "model_index.json")):
        path, config = registry.read_model_config(source)
        spec = registry.family_of(source)
        # a family whose model reads pipeline folders (experts) takes it whole, else its denoiser's
        whole = config[registry.PIPELINE_KEY].get("_class_name") in spec.models
        return spec, source if whole else os.path.dirname(path), None
    if os.path.isfile(os.path.join(source, "config.json")):
        return registry.family_of(source), source, None
    raise FileNotFoundError(f"{source} is neither a training checkpoint (recipe.json, model/), a diffusers pipeline "
                            "folder (model_index.json) nor a model folder (config.json)")


def _layout(overrides) -> dict:
    """The parallel section the ``--set parallel.KEY=VALUE`` values give (nothing else is taken)."""
    values = {}
    for text in overrides:
        section, key, value = parse_override(text)
        if section != "parallel":
            raise ValueError(f"--set {text}: generate takes only parallel.KEY=VALUE (the layout)")
        values[key] = value
    return values


def load_model(spec, folder: str, topo, recipe=None, checkpoint: Optional[str] = None):
    """The model chunks this rank holds (one per virtual pipeline stage), with the checkpoint's
    LoRA adapters when its run trained some."""
    model_class = spec.model_class(registry.read_model_config(folder)[1])
    chunks = [model_class.from_pretrained(folder, topo, chunk=c) for c in range(topo.config.vpp)]
    lora = recipe.model.lora if recipe is not None else None
    if lora:
        config = spec.lora_config_class()(**lora.options())
        parallelize = spec.plan_function()
        for chunk in chunks:
            parallelize(chunk, **{**plan_options(recipe, config), "recompute": "none"})
            chunk.load_adapter(os.path.join(checkpoint, "adapters"))
    return chunks


# -- the command ------------------------------------------------------------------------------


def generate(args) -> Dict:
    """Run on this rank (every rank of a launch runs it); returns what was made."""
    import mm_parallel

    spec, folder, recipe = resolve_source(args.source, args.overrides)
    layout = recipe.parallel if recipe is not None else mm_parallel.ParallelConfig(**_layout(args.overrides))
    topo = mm_parallel.initialize(layout)
    if spec.generate is None:
        raise ValueError(f"family {spec.name} has no generation")
    chunks = load_model(spec, folder, topo, recipe, args.source)
    return spec.generate(args, spec, folder, recipe, topo, chunks)


def run(args) -> int:
    if args.nproc > 1 and "RANK_ID" not in os.environ:
        return _launch(args)
    generate(args)
    return 0


def _worker_argv(args):
    argv = ["generate", args.source, "--prompt", args.prompt, "--seed", str(args.seed), "--nproc", str(args.nproc),
            "--max-new-tokens", str(args.max_new_tokens)]
    flags = ("image", "video", "out", "frames", "height", "width", "steps", "guidance", "sampler", "negative_prompt")
    for flag in flags:
        value = getattr(args, flag)
        if value is not None:
            argv += [f"--{flag.replace('_', '-')}", str(value)]
    for override in args.overrides:
        argv += ["--set", override]
    return argv


def _launch(args) -> int:
    from mm_parallel.launch import DistributedRunError, launch

    log_dir = Path(os.path.abspath(args.out or ".")).parent / "generate_logs"
    for old in log_dir.glob("worker_*.log"):
        old.unlink()
    relay = LogRelay(log_dir / "worker_0.log")
    try:
        launch(Path(__file__).with_name("_worker.py"), args.nproc, _worker_argv(args), timeout=args.timeout,
               log_dir=log_dir, tick=relay)
    except DistributedRunError as error:
        report_failure(log_dir, args.nproc, error)
        return 1
    return 0
