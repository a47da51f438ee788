"""A LLaMA-Factory training YAML (what `llamafactory-cli train CONFIG.yaml` reads) as an mm recipe.

Its keys are HfArgumentParser fields (model, data, training and finetuning arguments); each one
either maps to a recipe key here, or is named in `Imported.left_out` with the reason. Defaults are
LLaMA-Factory's where mm's differ: the vision tower and the projector frozen, LoRA alpha twice the
rank, gradient clipping at 1.0, AdamW betas (0.9, 0.999) and eps 1e-8, weight decay 0.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, Optional

import yaml

from mm_train import registry
from mm_train.families.importing.imported import Imported

# model_name_or_path read as its folder's config.json where it exists, else by its name
NAMES = (("qwen3-vl", "a3b", "qwen3_vl_moe"), ("qwen3-vl", "a22b", "qwen3_vl_moe"), ("qwen3-vl", "", "qwen3_vl"),
         ("qwen2.5-omni", "", "qwen2_5_omni"), ("qwen2.5-vl", "", "qwen2_5_vl"))
SCHEDULES = {"cosine": "cosine", "linear": "linear", "constant": "constant", "constant_with_warmup": "constant"}
PREF_LOSSES = {"sigmoid": "sigmoid", "ipo": "ipo", "hinge": "hinge"}
REPORTERS = {"wandb": "logging.wandb", "swanlab": "logging.swanlab", "mlflow": "logging.mlflow",
             "tensorboard": "logging.tensorboard"}
# settings that only steer LLaMA-Factory's own process (the chat template is the family's own in mm)
MACHINERY = {"do_train", "trust_remote_code", "overwrite_cache", "overwrite_output_dir", "plot_loss", "ddp_timeout",
             "preprocessing_num_workers", "save_only_model", "resume_from_checkpoint", "flash_attn",
             "dataloader_num_workers", "template"}


def family_of(model: str) -> str:
    folder = Path(model)
    if (folder / "config.json").is_file() or (folder / "model_index.json").is_file():
        return registry.family_of(str(folder)).name
    name = folder.name.lower()
    for first, second, family in NAMES:
        if first in name and second in name:
            return family
    raise ValueError(f"model_name_or_path {model!r}: no config.json there and the name names no family mm trains "
                     f"({sorted(registry.families())}); point it at the model folder")


def import_config(path: Path, nproc: int = 1) -> Imported:
    args = yaml.safe_load(path.read_text()) or {}
    if not isinstance(args, dict):
        raise ValueError(f"{path} must hold LLaMA-Factory's arguments as a mapping")
    out = Imported(source=str(path), kind="llamafactory", world_size=nproc)
    _model(out, args)
    _data(out, args)
    _train(out, args, nproc)
    _method(out, args, path.parent)
    _logging(out, args)
    for key in args:
        if key in MACHINERY:
            out.not_needed.append(key)
        elif key not in HANDLED:
            out.leave_out(f"{key}: {args[key]!r}", "no mm equivalent")
    return out


HANDLED = ("model_name_or_path", "image_max_pixels", "image_min_pixels", "video_max_pixels", "video_min_pixels",
           "video_fps", "video_maxlen", "stage", "finetuning_type", "lora_rank", "lora_alpha", "lora_dropout",
           "lora_target", "freeze_vision_tower", "freeze_multi_modal_projector", "freeze_language_model", "deepspeed",
           "dataset", "dataset_dir", "cutoff_len", "max_samples", "neat_packing", "packing", "output_dir",
           "save_steps", "save_total_limit", "per_device_train_batch_size", "gradient_accumulation_steps",
           "learning_rate", "lr_scheduler_type", "weight_decay", "max_grad_norm", "adam_beta1", "adam_beta2",
           "adam_epsilon", "bf16", "fp16", "seed", "pref_beta", "pref_loss", "pref_ftx", "dpo_label_smoothing",
           "eval_steps", "val_size", "per_device_eval_batch_size", "logging_steps", "report_to", "num_train_epochs",
           "max_steps", "warmup_ratio", "warmup_steps")


def _model(out: Imported, args: Dict[str, Any]) -> None:
    model = args.get("model_name_or_path")
    if not model:
        raise ValueError("the YAML names no model_name_or_path: LLaMA-Factory needs one too")
    out.set("model.family", family_of(str(model)))
    out.set("model.path", str(model))
    if args.get("image_max_pixels") is not None:
        out.set("data.max_pixels", int(args["image_max_pixels"]))
    if args.get("image_min_pixels") is not None:
        out.set("data.min_pixels", int(args["image_min_pixels"]))
    for key in ("video_max_pixels", "video_min_pixels"):
        if key in args and args[key] != args.get(key.replace("video", "image")):
            out.leave_out(f"{key}: {args[key]}", "mm bounds images and video frames with one pair "
                                                 "(data.min_pixels / max_pixels, set from image_*_pixels)")
    if args.get("video_fps") is not None:
        out.set("data.video_fps", float(args["video_fps"]))
    if "video_maxlen" in args:
        out.leave_out(f"video_maxlen: {args['video_maxlen']}", "mm samples every clip at data.video_fps whole; "
                                                               "no frame cap")


def _data(out: Imported, args: Dict[str, Any]) -> None:
    datasets = args.get("dataset")
    if not datasets:
        raise ValueError("the YAML names no dataset")
    names = [d.strip() for d in str(datasets).split(",")] if isinstance(datasets, str) else list(datasets)
    folder = Path(args.get("dataset_dir", "data"))
    out.set("data.kind", "llamafactory")
    out.set("data.dataset_info", str(folder))  # LLaMA-Factory's dataset_dir: where dataset_info.json is
    out.set("data.dataset", names[0] if len(names) == 1 else names)
    if args.get("cutoff_len") is not None:
        out.set("data.max_length", int(args["cutoff_len"]))
    if args.get("neat_packing"):
        out.set("data.packing", True)
    elif args.get("packing"):
        out.leave_out("packing: true", "LLaMA-Factory's plain packing lets a row's samples attend to each other; mm "
                                       "packs only as neat_packing does (data.packing: each sample on its own)")
        out.set("data.packing", True)
    else:
        out.set("data.packing", False)  # LLaMA-Factory pads unless told to pack
    if args.get("max_samples") is not None:
        out.leave_out(f"max_samples: {args['max_samples']}", "mm trains on the whole data set; cut the file instead")
    for key in ("val_size", "eval_steps", "per_device_eval_batch_size"):
        if key in args:
            out.leave_out(f"{key}: {args[key]}", "set eval.fraction / eval.every / eval.batch_size (mm holds out a "
                                                 "share by seed)")


def _steps(args: Dict[str, Any], out: Imported, global_batch: int) -> int:
    if args.get("max_steps") and int(args["max_steps"]) > 0:
        return int(args["max_steps"])
    epochs = float(args.get("num_train_epochs", 3.0))
    count = _sample_count(out)
    if count is None:
        out.leave_out(f"num_train_epochs: {epochs}", "the data set could not be counted here: set train.steps "
                                                     "(epochs x samples / global batch)")
        return 1000
    return max(1, math.ceil(epochs * count / global_batch))


def _sample_count(out: Imported) -> Optional[int]:
    """Samples in the named data sets (their files' records), or None when they cannot be read."""
    folder = Path(out.get("data.dataset_info"))
    try:
        entries = json.loads((folder / "dataset_info.json").read_text())
        names = out.get("data.dataset")
        total = 0
        for name in [names] if isinstance(names, str) else names:
            file = folder / entries[name]["file_name"]
            text = file.read_text()
            total += len(json.loads(text)) if text.lstrip().startswith("[") else len(text.splitlines())
        return total
    except (OSError, KeyError, TypeError, ValueError):
        return None


def _train(out: Imported, args: Dict[str, Any], nproc: int) -> None:
    micro = int(args.get("per_device_train_batch_size", 8))
    accumulation = int(args.get("gradient_accumulation_steps", 1))
    out.set("train.micro_batch_size", micro)
    out.set("train.global_batch_size", micro * accumulation * nproc)
    steps = _steps(args, out, micro * accumulation * nproc)
    out.set("train.steps", steps)
    out.set("train.seed", int(args.get("seed", 42)))
    out.set("train.precision", "bf16" if args.get("bf16") else "fp16" if args.get("fp16") else "fp32")
    if args.get("logging_steps") is not None:
        out.set("train.log_every", int(args["logging_steps"]))
    schedule = str(args.get("lr_scheduler_type", "linear"))
    if schedule not in SCHEDULES:
        out.leave_out(f"lr_scheduler_type: {schedule}", f"mm's schedules are {sorted(set(SCHEDULES.values()))}; "
                                                        "cosine used")
    warmup = int(args["warmup_steps"]) if args.get("warmup_steps") else round(float(args.get("warmup_ratio", 0.0))
                                                                                * steps)
    out.recipe["optim"] = {
        "lr": float(args.get("learning_rate", 5e-5)), "lr_schedule": SCHEDULES.get(schedule, "cosine"),
        "warmup_steps": warmup, "decay_steps": steps, "min_lr": 0.0,
        "weight_decay": float(args.get("weight_decay", 0.0)), "clip_grad": float(args.get("max_grad_norm", 1.0)),
        "betas": [float(args.get("adam_beta1", 0.9)), float(args.get("adam_beta2", 0.999))],
        "eps": float(args.get("adam_epsilon", 1e-8))}
    out.set("output_dir", str(args.get("output_dir", "runs/imported")))
    if args.get("save_steps"):
        out.set("checkpoint.every", int(args["save_steps"]))
    if args.get("save_total_limit"):
        out.set("checkpoint.keep", int(args["save_total_limit"]))
    out.set("cluster.devices_per_node", nproc)


def _method(out: Imported, args: Dict[str, Any], here: Path) -> None:
    stage = str(args.get("stage", "sft"))
    if stage == "dpo":
        out.set("train.objective", "dpo")
        loss = str(args.get("pref_loss", "sigmoid"))
        if loss not in PREF_LOSSES:
            raise ValueError(f"pref_loss {loss!r}: mm's DPO losses are {sorted(PREF_LOSSES)}")
        out.recipe["dpo"] = {"method": PREF_LOSSES[loss], "beta": float(args.get("pref_beta", 0.1)),
                             "label_smoothing": float(args.get("dpo_label_smoothing", 0.0)),
                             "sft_weight": float(args.get("pref_ftx", 0.0))}
    elif stage != "sft":
        raise ValueError(f"stage {stage!r}: mm imports LLaMA-Factory's sft and dpo stages (GRPO is mm's own "
                         "train.objective: grpo)")
    finetuning = str(args.get("finetuning_type", "lora"))
    if finetuning == "lora":
        rank = int(args.get("lora_rank", 8))
        lora: Dict[str, Any] = {"r": rank, "alpha": float(args.get("lora_alpha") or 2 * rank),
                                "dropout": float(args.get("lora_dropout", 0.0))}
        target = args.get("lora_target", "all")
        if target != "all":
            lora["target_modules"] = [t.strip() for t in str(target).split(",")] if isinstance(target, str) \
                else list(target)
        out.set("model.lora", lora)
        if stage == "dpo":
            out.set("dpo.reference", "adapters_off")  # LLaMA-Factory's reference under LoRA: the adapters off
    elif finetuning == "freeze":
        raise ValueError("finetuning_type freeze (training the last layers only) has no mm equivalent: use full "
                         "or lora")
    frozen = [part for key, part, default in (("freeze_vision_tower", "vision", True),
                                              ("freeze_multi_modal_projector", "merger", True),
                                              ("freeze_language_model", "language_model", False))
              if args.get(key, default)]
    if frozen:
        out.set("model.freeze", frozen)
    if args.get("deepspeed"):
        _deepspeed(out, str(args["deepspeed"]), here)


def _deepspeed(out: Imported, path: str, here: Path) -> None:
    """ZeRO stage and optimizer offload from the DeepSpeed JSON LLaMA-Factory hands to DeepSpeed."""
    file = Path(path) if Path(path).is_file() else here / path
    try:
        zero = json.loads(file.read_text()).get("zero_optimization", {})
    except (OSError, ValueError) as error:
        out.leave_out(f"deepspeed: {path}", f"not readable ({error.__class__.__name__}): set parallel.zero_stage")
        return
    stage = int(zero.get("stage", 0))
    out.set("parallel.zero_stage", stage)
    offload = (zero.get("offload_optimizer") or {}).get("device", "none")
    if offload == "cpu":
        out.set("optim.offload", "optimizer")
    if (zero.get("offload_param") or {}).get("device", "none") == "cpu":
        out.leave_out("deepspeed offload_param: cpu", "mm offloads optimizer state (optim.offload), not weights")


def _logging(out: Imported, args: Dict[str, Any]) -> None:
    reporters = args.get("report_to", "none")
    for name in [reporters] if isinstance(reporters, str) else list(reporters or []):
        if name in ("none", "all"):
            continue
        if name not in REPORTERS:
            out.leave_out(f"report_to: {name}", f"mm's trackers are {sorted(REPORTERS)}")
        elif name == "tensorboard":
            out.set("logging.tensorboard", True)
        else:
            out.set(REPORTERS[name], {})
