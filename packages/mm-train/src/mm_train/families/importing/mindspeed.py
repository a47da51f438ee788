"""A MindSpeed-MM launch script (MindSpore or torch backend) with its model and data JSON as an mm recipe.

The script is read by `importing.shell` (assignments and arithmetic evaluated, never run); its
training command's Megatron flags map to the layout, batch, optimizer and schedule; `--mm-model`
names the family (the JSON's model_id) and its freeze flags and pipeline split; `--mm-data` the data
(LLaMA-Factory-style files with an `attr` mapping for the VL families; for video, MindSpeed-MM's
pre-extracted feature sets are torch pickles mm never reads: listed, with what to point at instead).
Every flag or key without an mm equivalent is listed with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

import yaml

from mm_train.families.importing import megatron
from mm_train.families.importing.imported import Imported
from mm_train.families.importing.shell import read_script

# MindSpeed-MM's model_id of the model JSON (text decoder / predictor) -> the mm family
FAMILIES = {"qwen2_5vl": "qwen2_5_vl", "qwen2_5_vl": "qwen2_5_vl", "qwen3vl": "qwen3_vl", "qwen3_vl": "qwen3_vl",
            "qwen3_vl_moe": "qwen3_vl_moe", "qwen2_5_omni": "qwen2_5_omni", "qwen2_5omni": "qwen2_5_omni",
            "qwen2_5_omni_thinker": "qwen2_5_omni",
            "wandit": "wan", "satdit": "cogvideox",
            "cogvideox": "cogvideox"}
DEFAULT_ATTR = {"messages": "messages", "role_tag": "role", "content_tag": "content", "user_tag": "user",
                "assistant_tag": "assistant"}
VL_TAGS = ("role_tag", "content_tag", "user_tag", "assistant_tag", "observation_tag", "function_tag", "system_tag")


def _json(path: Optional[str], script_dir: Path, what: str, out: Imported) -> Optional[dict]:
    """A JSON the script names, found as given, beside the script, or by its name beside the script."""
    if not path:
        return None
    for candidate in (Path(path), script_dir / path, script_dir / Path(path).name):
        if candidate.is_file():
            return json.loads(candidate.read_text())
    out.leave_out(f"{what} {path}", "not found (give it with --model / --data): its settings are not in the recipe")
    return None


def _yaml_config(args, script_dir: Path) -> Optional[dict]:
    """The YAML the program is given first (MindSpeed-MM's transformers-backend trainer), if any."""
    first = next((a for a in args if not a.startswith("-")), None) if args and not args[0].startswith("-") else None
    if not first or not first.endswith((".yaml", ".yml")):
        return None
    for candidate in (Path(first), script_dir / first, script_dir / Path(first).name):
        if candidate.is_file():
            return yaml.safe_load(candidate.read_text()) or {}
    raise ValueError(f"the script's config {first} is not found beside it or from here: run the import from the "
                     "folder the script runs in")


def family_of(model: dict) -> str:
    """The family of a MindSpeed-MM model JSON (its text decoder's or predictor's model_id, else its own)."""
    ids = [(model.get(part) or {}).get("model_id") for part in ("text_decoder", "predictor")] + [model.get("model_id")]
    for model_id in ids:
        if model_id in FAMILIES:
            decoder = model.get("text_decoder") or {}
            if FAMILIES[model_id] == "qwen3_vl" and (decoder.get("num_moe_experts") or decoder.get("num_experts")):
                return "qwen3_vl_moe"
            return FAMILIES[model_id]
    raise ValueError(f"model JSON model_id {[i for i in ids if i]}: mm trains {sorted(set(FAMILIES.values()))}")


def import_script(path: Path, model_json: Optional[str] = None, data_json: Optional[str] = None,
                  beside: Optional[Path] = None, variables: Optional[Dict[str, str]] = None) -> Imported:
    """The recipe of the script at ``path``; a dataset_info.json it needs is written to ``beside``
    (default: the current folder), where the recipe goes; ``variables`` replace the script's own
    (a node count it reads from a hostfile, say)."""
    script = read_script(path.read_text(), variables)
    if script.program is None:
        raise ValueError(f"{path}: no msrun / torchrun / python line runs a .py file; is it a launch script?")
    out = Imported(source=str(path), kind="mindspeed")
    found = megatron.read_flags(out, script)
    config = _yaml_config(script.args, path.parent)
    if config is not None:  # the YAML-configured (FSDP2) trainer: flags under gpt_args, model and data inline
        found.update(megatron.config_flags({**(config.get("gpt_args") or {}), **(config.get("lora_args") or {})}))
    model = (config or {}).get("model") or _json(model_json or found.get("mm-model"), path.parent, "--mm-model", out)
    if model is None:
        raise ValueError(f"{path}: the model JSON (--mm-model) is needed to know the family: give it with --model")
    family = family_of(model)
    out.set("model.family", family)
    _model(out, model, family)
    data = (config or {}).get("data") or _json(data_json or found.get("mm-data"), path.parent, "--mm-data", out)
    if model.get("init_from_hf_path"):
        out.set("model.path", str(model["init_from_hf_path"]))
    if data is not None:
        if family.startswith("qwen"):
            _vl_data(out, data, beside or Path.cwd())
        else:
            _video_data(out, data)
    if found.get("load") is True:  # `--load $EMPTY`: nothing to load
        del found["load"]
    if not family.startswith("qwen") and found.get("load"):
        video_model_path(out, str(found.pop("load")))
    megatron.apply_flags(out, found, layers=_layers(model))
    return out


def _layers(model: dict) -> Optional[int]:
    part = model.get("text_decoder") or model.get("predictor") or {}
    return part.get("num_layers")


def _model(out: Imported, model: dict, family: str) -> None:
    if family.startswith("qwen"):
        encoder = model.get("image_encoder") or {}
        frozen = [name for name, part in (("vision", encoder.get("vision_encoder")),
                                          ("merger", encoder.get("vision_projector")),
                                          ("language_model", model.get("text_decoder")),
                                          ("audio", (model.get("audio_encoder") or {}).get("audio_encoder")))
                  if (part or {}).get("freeze")]
        if frozen:
            out.set("model.freeze", frozen)
        split = (model.get("text_decoder") or {}).get("pipeline_num_layers")
    else:
        split = (model.get("predictor") or {}).get("pipeline_num_layers")
        _video_encoders(out, model)
        if model.get("task"):
            out.leave_out(f"model JSON task: {model['task']}", "mm reads t2v / i2v from the model folder's config "
                                                               "(image_dim) and the data")
    if split and len({str(counts) for counts in split}) > 1:  # an even split is mm's own default
        out.set("parallel.pp_layers", split)


def _vl_data(out: Imported, data: dict, beside: Path) -> None:
    param = data.get("dataset_param") or {}
    pre, basic, attr = (param.get(k) or {} for k in ("preprocess_parameters", "basic_parameters", "attr"))
    out.set("data.kind", "llamafactory")
    if pre.get("model_name_or_path"):
        out.set("model.path", pre["model_name_or_path"])
    for key, target in (("image_max_pixels", "data.max_pixels"), ("image_min_pixels", "data.min_pixels")):
        if pre.get(key):
            out.set(target, int(pre[key]))
    if pre.get("video_fps"):
        out.set("data.video_fps", float(pre["video_fps"]))
    for key in ("video_max_pixels", "video_maxlen"):
        if pre.get(key) is not None:
            out.leave_out(f"{key}: {pre[key]}", "mm bounds video frames as images and samples clips whole at "
                                                "data.video_fps")
    if basic.get("cutoff_len"):
        out.set("data.max_length", int(basic["cutoff_len"]))
    files = [f.strip() for f in str(basic.get("dataset", "")).split(",") if f.strip()]
    if not files:
        out.leave_out("basic_parameters.dataset", "no data file named: set data.path")
        return
    renamed = {k: v for k, v in attr.items() if v is not None and DEFAULT_ATTR.get(k, k) != v}
    if len(files) == 1 and not renamed:
        out.set("data.path", files[0])
        if basic.get("dataset_dir"):
            out.set("data.media_dir", basic["dataset_dir"])
        return
    # other column or tag names: declared in a dataset_info.json, as LLaMA-Factory reads them
    columns = {k: v for k, v in attr.items() if v is not None and k not in VL_TAGS}
    tags = {k: v for k, v in attr.items() if v is not None and k in VL_TAGS}
    entries = {f"set{k}": {"file_name": str(Path(f).resolve()), "formatting": "sharegpt", "columns": columns,
                           "tags": tags} for k, f in enumerate(files)}
    beside.mkdir(parents=True, exist_ok=True)
    (beside / "dataset_info.json").write_text(json.dumps(entries, indent=1))
    out.set("data.dataset_info", str(beside))
    out.set("data.dataset", sorted(entries) if len(entries) > 1 else "set0")
    if basic.get("dataset_dir"):
        out.set("data.media_dir", str(Path(basic["dataset_dir"]).resolve()))


def _video_data(out: Imported, data: dict) -> None:
    param = data.get("dataset_param") or {}
    pre, basic = param.get("preprocess_parameters") or {}, param.get("basic_parameters") or {}
    out.set("data.kind", "video")
    if pre.get("num_frames"):
        out.set("data.num_frames", int(pre["num_frames"]))
    area = pre.get("max_hxw") or (pre.get("max_height") or 0) * (pre.get("max_width") or 0)
    if area:
        out.set("data.max_area", int(area))
    if pre.get("train_fps"):
        out.set("data.fps", float(pre["train_fps"]))
    tokenizers = param.get("tokenizer_config") or []
    tokenizer = tokenizers[0] if isinstance(tokenizers, list) and tokenizers else tokenizers
    if isinstance(tokenizer, dict) and tokenizer.get("model_max_length"):
        out.set("data.text_max_length", int(tokenizer["model_max_length"]))
    if isinstance(tokenizer, dict) and tokenizer.get("from_pretrained"):
        out.set("data.tokenizer", str(tokenizer["from_pretrained"]))
    if param.get("dataset_type") == "feature":
        out.leave_out(f"feature data set {basic.get('data_path')}", "MindSpeed-MM's features are torch pickles, "
                                                                    "which mm never loads: set data.path to the "
                                                                    "videos' annotation file (mm encodes and caches "
                                                                    "the features itself)")
    elif basic.get("data_path"):
        out.set("data.path", basic["data_path"])


def video_model_path(out: Imported, load: str) -> None:
    """--load of a video script: a diffusers transformer folder (Wan) has the pipeline folder around
    it, which mm reads whole (the denoiser and, by default, its VAE, text encoder and tokenizer);
    anything else is MindSpeed-MM's own converted checkpoint."""
    folder = Path(load.rstrip("/"))
    if folder.name in ("transformer", "transformer_2"):
        out.set("model.path", str(folder.parent))
    else:
        out.leave_out(f"--load {load}", "MindSpeed-MM's converted checkpoint: set model.path to the diffusers "
                                        "folder (a pipeline folder, or its transformer/)")


def _video_encoders(out: Imported, model: dict) -> None:
    """The model JSON's text encoder and VAE where they are folders mm reads (not torch pickles)."""
    text = model.get("text_encoder") if isinstance(model.get("text_encoder"), dict) else {}
    if text.get("from_pretrained"):
        out.set("data.text_encoder", str(text["from_pretrained"]))
    vae = model.get("ae") if isinstance(model.get("ae"), dict) else {}
    source = str(vae.get("from_pretrained") or "")
    if source.endswith((".pt", ".pth", ".ckpt", ".bin")):
        out.leave_out(f"ae.from_pretrained: {source}", "a torch pickle, which mm never loads: set data.vae to the "
                                                       "diffusers VAE folder")
    elif source:
        out.set("data.vae", source)
    if model.get("enable_encoder_dp"):  # the clips encoded in the step, shared out over the tp x cp ranks
        out.set("data.online", True)
        out.set("data.encoder_dp", True)
