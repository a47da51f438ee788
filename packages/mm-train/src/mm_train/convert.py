"""`mm-train convert`: checkpoints to Hugging Face folders, LoRA adapters merged into their base.

- ``merge-lora BASE ADAPTERS OUT``: the base model (a Hugging Face / diffusers folder of a
  registered family, recognised by its config.json) with PEFT adapters folded into its weights (W + alpha / r * B A),
  written
  as a folder of the same format; the base's other files (tokenizer, processor, generation config)
  are copied along.
- ``checkpoint STEP_DIR OUT``: a training checkpoint (OUT/checkpoints/step_N) as a standalone
  folder, its LoRA adapters merged if the run trained some, with the files that make it a whole
  model folder: those beside the weights of the run's model.path (the originals: tokenizer,
  processor, chat template, generation config), else what the family writes from the recipe the
  checkpoint recorded (the tokenizer it trained with, its chat template, its processor settings).
- ``experts SRC OUT --layout L``: a MoE model's expert tensors rewritten in another layout (fused
  in-memory, the hub's transposed fused, or per-expert keys; mm_parallel.moe.checkpoint), every
  other tensor and file as it is. Any layout loads as it is; this is for tools that need one.

Why there is no "sharded checkpoint of a layout": every checkpoint here is a whole Hugging Face
folder and `from_pretrained(path, topology)` cuts each rank's shard while reading, so any layout
loads any checkpoint directly (resuming TP2 -> 1, PP2 -> 1, DP2 -> 1, 1 -> TP2 is tested); a
per-layout copy would only be a second format to keep in step.
"""

from __future__ import annotations

import json
import os
import shutil

from mm_train import registry
from mm_train.recipe import load_recipe

# Deferred imports: MindSpore and mm-parallel (the CLI starts without loading MindSpore).

WEIGHT_FILES = (".safetensors", ".safetensors.index.json", ".bin", ".pt", ".pth", ".ckpt")


def merge_lora(base: str, adapters: str, out: str) -> str:
    """Write ``base`` with the PEFT ``adapters`` merged into ``out``; returns ``out``. A diffusers
    pipeline folder of several denoisers has each denoiser's adapters in a sub-folder of its name."""
    import mm_parallel
    from mm_parallel.lora import apply_lora
    from mm_parallel.lora import merge_lora as fold

    if not os.path.isfile(os.path.join(adapters, "adapter_config.json")) and \
            os.path.isfile(os.path.join(base, "model_index.json")):
        return _merge_pipeline(base, adapters, out)
    with open(os.path.join(adapters, "adapter_config.json")) as f:
        config = json.load(f)
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{adapters} holds {config.get('peft_type')} adapters; only LoRA can be merged")
    topo = mm_parallel.initialize(mm_parallel.ParallelConfig())  # one process holds the whole model
    model = registry.model_class_of(base).from_pretrained(base, topo)
    targets = config["target_modules"]
    apply_lora(model, [targets] if isinstance(targets, str) else list(targets), int(config["r"]),
               float(config.get("lora_alpha", config["r"])), float(config.get("lora_dropout", 0.0)))
    model.load_adapter(adapters)
    fold(model)
    model.save_pretrained(out)
    _copy_side_files(base, out)
    return out


def _merge_pipeline(base: str, adapters: str, out: str) -> str:
    """A pipeline folder's denoisers each merged with the adapters of its sub-folder; its other
    files and folders copied."""
    adapted = [name for name in sorted(os.listdir(adapters))
               if os.path.isfile(os.path.join(adapters, name, "adapter_config.json"))]
    if not adapted:
        raise FileNotFoundError(f"{adapters} holds no adapter_config.json, nor sub-folders with one (a pipeline's "
                                "denoisers' adapters)")
    for name in adapted:
        merge_lora(os.path.join(base, name), os.path.join(adapters, name), os.path.join(out, name))
    for name in os.listdir(base):
        source, target = os.path.join(base, name), os.path.join(out, name)
        if name not in adapted and not os.path.exists(target):
            (shutil.copytree if os.path.isdir(source) else shutil.copy2)(source, target)
    return out


def _copy_side_files(source: str, out: str) -> None:
    """The files beside the weights (tokenizer, processor, generation config), not config.json."""
    for name in os.listdir(source):
        path = os.path.join(source, name)
        if os.path.isfile(path) and name != "config.json" and not name.endswith(WEIGHT_FILES) \
                and not os.path.exists(os.path.join(out, name)):
            shutil.copy2(path, os.path.join(out, name))


def export_checkpoint(step_dir: str, out: str) -> str:
    """A training checkpoint's model as a standalone folder (LoRA merged when present)."""
    model, adapters = os.path.join(step_dir, "model"), os.path.join(step_dir, "adapters")
    if not os.path.isfile(os.path.join(step_dir, "trainer_state.json")) or not os.path.isdir(model):
        raise FileNotFoundError(f"{step_dir} is not a complete training checkpoint (model/ and trainer_state.json)")
    if os.path.isdir(adapters):
        merge_lora(model, adapters, out)
    else:
        shutil.copytree(model, out, dirs_exist_ok=True)
    for line in _processing_files(step_dir, out):
        print(line)
    return out


def _processing_files(step_dir: str, out: str) -> list:
    """The files beside the weights (see the module docstring); returns what it did, a line each."""
    recorded = os.path.join(step_dir, "recipe.json")
    if not os.path.isfile(recorded):
        return [f"{step_dir} records no recipe.json (a checkpoint from before mm-train 0.1.7): only the model "
                "was exported; copy the tokenizer and processor files into it by hand"]
    recipe = load_recipe(recorded)
    source = recipe.model.path
    if source and os.path.isdir(source):
        before = set(os.listdir(out))
        _copy_side_files(source, out)
        return [f"copied from {source}: {', '.join(sorted(set(os.listdir(out)) - before)) or 'nothing new'}"]
    if recipe.family.processing is None:
        return []
    written = recipe.family.processing(recipe, out)
    return [f"wrote {', '.join(written)} (the run's tokenizer and processor settings)"]


# mm_parallel.moe.checkpoint.LAYOUTS, named here so the CLI starts without importing MindSpore (a test checks)
EXPERT_LAYOUTS = ("fused", "fused_transposed", "per_expert")


def convert_experts(source: str, out: str, layout: str) -> str:
    """``source`` with its MoE expert tensors in ``layout`` written to ``out``; returns ``out``."""
    from mm_parallel.moe.checkpoint import convert_folder

    found = convert_folder(source, out, layout)
    if not found:
        raise ValueError(f"{source} holds no MoE expert tensors (...experts.gate_up_proj or "
                         "...experts.0.gate_proj.weight)")
    print(f"{len(found)} expert stacks, read as {', '.join(sorted(set(found.values())))}, written as {layout}")
    return out


def add_parser(commands) -> None:
    convert = commands.add_parser(
        "convert", help="checkpoints to Hugging Face folders; merge LoRA adapters",
        description=__doc__.split("\n\n")[0] + " Layout changes need no conversion: any layout loads any checkpoint.")
    which = convert.add_subparsers(dest="conversion", required=True)
    merge = which.add_parser("merge-lora", help="fold PEFT LoRA adapters into their base model",
                             description="Write BASE with ADAPTERS merged (W + alpha / r * B A) into OUT.")
    merge.add_argument("base", help="the base model folder (Hugging Face / diffusers, of a registered family)")
    merge.add_argument("adapters", help="a PEFT adapter folder (adapter_config.json, adapter_model.safetensors)")
    merge.add_argument("out", help="the merged model folder to write")
    export = which.add_parser("checkpoint", help="a training checkpoint as a standalone model folder",
                              description="Write the model of OUT/checkpoints/step_N into OUT, LoRA merged.")
    export.add_argument("step_dir", help="a checkpoint folder, e.g. runs/x/checkpoints/step_100")
    export.add_argument("out", help="the model folder to write")
    experts = which.add_parser("experts", help="rewrite MoE expert tensors in another layout",
                               description="Write SRC into OUT with its expert tensors in --layout.")
    experts.add_argument("source", help="a Hugging Face folder of a MoE model")
    experts.add_argument("out", help="the folder to write")
    experts.add_argument("--layout", required=True, choices=EXPERT_LAYOUTS,
                         help="fused: (E, 2I, H) / (E, H, I), transformers' in-memory layout; fused_transposed: the "
                              "hub's (E, H, 2I) / (E, I, H); per_expert: experts.{e}.gate_proj / up_proj / down_proj")


def run(args) -> int:
    if args.conversion == "merge-lora":
        out = merge_lora(args.base, args.adapters, args.out)
    elif args.conversion == "experts":
        out = convert_experts(args.source, args.out, args.layout)
    else:
        out = export_checkpoint(args.step_dir, args.out)
    print(f"wrote {out}")
    return 0
