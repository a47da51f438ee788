"""Recipes: one YAML file per training run, typed and checked before any process starts.

    model:      family (qwen2_5_vl | wan), path (a Hugging Face folder) or config (a tiny one inline),
                recompute, lora, freeze
    data:       kind (vl: tiny_vl, the built-in set | llamafactory, a LLaMA-Factory JSON / JSONL;
                wan: tiny_video, the built-in set | video, annotations + encoders | video_features,
                a feature cache), path, tokenizer, max_length, ..., num_workers, max_bad_fraction
    parallel:   the fields of mm_parallel.ParallelConfig (tp, pp, vpp, cp, cp_algo, ...)
    optim:      the fields of mm_parallel.OptimizerConfig (lr, lr_schedule, warmup_steps, ...)
    train:      steps, global_batch_size, micro_batch_size, seed, log_every
    checkpoint: every, keep
    diffusion:  shift, num_train_timesteps, density, weighting (flow matching; video models)
    profile:    the fields of mm_profiling.ProfileConfig (enable, start_step, end_step, ...)
    output_dir

``--set section.key=value`` overrides any field (the value read as YAML: ``--set parallel.tp=2``,
``--set optim.betas=[0.9,0.95]``); a longer path reaches into a mapping field
(``--set model.config.text_config.num_hidden_layers=4``). An unknown section or key is an error naming the closest valid
one; `check_layout` refuses a layout the world size or the batch sizes cannot hold. The global batch
is a property of the run, not of the layout: micro-batches per step = global / (micro x dp), so the
losses of one recipe are comparable across layouts.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import yaml

MODEL_FAMILIES = ("qwen2_5_vl", "wan")
DATA_KINDS = {"qwen2_5_vl": ("tiny_vl", "llamafactory"), "wan": ("tiny_video", "video", "video_features")}


@dataclass
class ModelSection:
    family: str = "qwen2_5_vl"
    path: Optional[str] = None  # a Hugging Face folder; None: build from ``config`` with random weights
    config: Dict[str, Any] = field(default_factory=dict)  # the transformers config, inline
    recompute: str = "none"
    recompute_num_layers: Optional[int] = None
    lora: Optional[Dict[str, Any]] = None  # {r, alpha, dropout, target_modules}
    freeze: List[str] = field(default_factory=list)

    def __post_init__(self):
        if self.family not in MODEL_FAMILIES:
            raise ValueError(f"model.family {self.family!r} is not available; choose one of {MODEL_FAMILIES}")
        if self.path is None and not self.config:
            raise ValueError("model needs a path (a Hugging Face folder) or an inline config")


@dataclass
class DataSection:
    kind: str = "tiny_vl"  # vl: tiny_vl (built in) | llamafactory; wan: tiny_video (built in) | video | video_features
    path: Optional[str] = None  # tiny_*: where the set is generated (default: a cache folder); else the file / folder
    media_dir: Optional[str] = None  # where image / video paths start (default: the file's folder)
    tokenizer: Optional[str] = None  # a folder or tokenizer.json (default: model.path)
    samples: int = 256  # tiny_vl only
    max_length: int = 2048
    system: Optional[str] = "You are a helpful assistant."  # the default system turn; "" or null: none
    min_pixels: Optional[int] = None  # image / video frame pixel bounds (default: the processors')
    max_pixels: Optional[int] = None
    video_fps: float = 2.0
    num_workers: int = 0  # data worker processes
    max_bad_fraction: float = 0.01  # skipped bad samples beyond this share of the data set stop the run
    # video (wan): clips decoded from annotations (data.json / data.txt / data.jsonl / videos+labels),
    # encoded once by the VAE and text encoder into a feature cache, trained from the cache
    vae: Optional[str] = None  # a diffusers AutoencoderKLWan folder
    text_encoder: Optional[str] = None  # a transformers UMT5 encoder folder
    image_encoder: Optional[str] = None  # I2V: a transformers CLIP vision folder
    image_processor: Optional[str] = None  # I2V: its preprocessor_config.json folder (default: image_encoder)
    features_dir: Optional[str] = None  # the feature cache (default: output_dir/features)
    num_frames: int = 81  # clip length, 1 + 4n
    fps: float = 16.0
    max_area: int = 480 * 832
    text_max_length: int = 512
    caption_dropout: float = 0.0
    online: bool = False  # encode clips every step (random crops) instead of once into the cache

    def __post_init__(self):
        kinds = sorted({k for family in DATA_KINDS.values() for k in family})
        if self.kind not in kinds:
            raise ValueError(f"data.kind {self.kind!r} is not available; choose one of {kinds}")
        if self.kind in ("llamafactory", "video", "video_features") and not self.path:
            what = {"llamafactory": "a LLaMA-Factory JSON / JSONL file", "video": "video annotations",
                    "video_features": "a feature cache folder"}[self.kind]
            raise ValueError(f"data.kind {self.kind} needs data.path: {what}")
        if self.kind == "video" and not (self.vae and self.text_encoder):
            raise ValueError("data.kind video needs data.vae and data.text_encoder (the encoders of the feature cache)")


@dataclass
class DiffusionSection:
    """Flow matching for the video DiTs (mm_models_video.flow_matching)."""

    shift: float = 3.0
    num_train_timesteps: int = 1000
    density: str = "uniform"  # uniform | logit_normal | mode
    weighting: str = "none"  # none | sigma_sqrt | cosmap

    def __post_init__(self):
        from_choices = {"density": ("uniform", "logit_normal", "mode"), "weighting": ("none", "sigma_sqrt", "cosmap")}
        for name, choices in from_choices.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"diffusion.{name} {getattr(self, name)!r} is not one of {choices}")


@dataclass
class TrainSection:
    steps: int = 100
    global_batch_size: int = 8
    micro_batch_size: int = 4
    seed: int = 0
    log_every: int = 1
    max_nonfinite_steps: int = 3  # this many skipped steps in a row (nan / inf loss or gradient) stop the run

    def __post_init__(self):
        for name in ("steps", "global_batch_size", "micro_batch_size", "log_every", "max_nonfinite_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class CheckpointSection:
    every: int = 0  # 0: no checkpoints
    keep: int = 2


@dataclass
class Recipe:
    model: ModelSection
    data: DataSection
    parallel: Any  # mm_parallel.ParallelConfig
    optim: Any  # mm_parallel.OptimizerConfig
    train: TrainSection
    checkpoint: CheckpointSection
    profile: Dict[str, Any]
    diffusion: DiffusionSection = field(default_factory=DiffusionSection)
    output_dir: str = "runs/default"

    def __post_init__(self):
        kinds = DATA_KINDS[self.model.family]
        if self.data.kind not in kinds:
            raise ValueError(f"data.kind {self.data.kind!r} does not feed model.family {self.model.family}; "
                             f"choose one of {kinds}")

    def to_dict(self) -> dict:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
        return out


def _sections():
    from mm_parallel import OptimizerConfig, ParallelConfig

    return {"model": ModelSection, "data": DataSection, "parallel": ParallelConfig, "optim": OptimizerConfig,
            "train": TrainSection, "checkpoint": CheckpointSection, "diffusion": DiffusionSection}


def _unknown(kind: str, key: str, valid: Sequence[str]) -> ValueError:
    close = difflib.get_close_matches(key, list(valid), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(sorted(valid))}"
    return ValueError(f"unknown {kind} {key!r}{hint}")


def _check_types(section: str, cls, given: dict) -> None:
    """A number field given a non-number (or a flag given a non-bool) is an error naming it."""
    defaults = {f.name: f.default for f in fields(cls) if f.default is not dataclasses.MISSING}
    for key, value in given.items():
        default = defaults.get(key)
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, (int, float)):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if ok and isinstance(default, int) and not isinstance(default, bool) and isinstance(value, float):
                ok = value.is_integer()
                if ok:
                    given[key] = int(value)
        else:
            continue
        if not ok:
            raise ValueError(f"{section}.{key} must be a {type(default).__name__}, got {value!r}")


def _default(cls, name: str):
    """A dataclass field's default value (None if it has none or no such field)."""
    for f in fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    return None


def parse_override(text: str):
    """'section.key=value' (or 'output_dir=value') -> (section or None, key, value read as YAML)."""
    path, _, raw = text.partition("=")
    value = yaml.safe_load(raw) if raw != "" else ""
    if isinstance(value, str):  # YAML 1.1 reads 1e6 (no dot) as a string; it is meant as a number
        try:
            value = float(value) if any(c in value.lower() for c in ".en") else int(value)
        except ValueError:
            pass
    if _ and path == "output_dir":
        return None, path, str(value)
    if not _ or "." not in path:
        raise ValueError(f"--set takes section.key=value (e.g. parallel.tp=2) or output_dir=PATH, got {text!r}")
    section, key = path.split(".", 1)
    return section, key, value


def build_recipe(values: Optional[dict] = None, overrides: Sequence[str] = ()) -> Recipe:
    """A Recipe from a mapping (a loaded YAML file) and ``--set`` overrides."""
    values = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (values or {}).items()}
    sections = _sections()
    top = set(sections) | {"profile", "output_dir"}
    for key in values:
        if key not in top:
            raise _unknown("recipe section", key, top)
    for text in overrides:
        section, key, value = parse_override(text)
        if section is None:
            values[key] = value
            continue
        if section not in top or section == "output_dir":
            raise _unknown("recipe section", section, top - {"output_dir"})
        target = values.setdefault(section, {})
        *parents, leaf = key.split(".")  # model.config.text_config.num_hidden_layers=4 reaches into mappings
        for depth, part in enumerate(parents):
            inner = target.get(part)
            if inner is None and depth == 0 and section in sections:
                inner = _default(sections[section], part)
            if inner is None:
                inner = {}
            if not isinstance(inner, dict):
                raise ValueError(f"{section}.{'.'.join(parents[:depth + 1])} is not a mapping; cannot set {text!r}")
            target[part] = inner = dict(inner)
            target = inner
        target[leaf] = value
    built = {}
    for name, cls in sections.items():
        given = values.get(name) or {}
        names = [f.name for f in fields(cls)]
        for key in given:
            if key not in names:
                raise _unknown(f"{name} key", key, names)
        if name == "optim" and "betas" in given:
            given["betas"] = tuple(given["betas"])
        _check_types(name, cls, given)
        built[name] = cls(**given)
    profile = values.get("profile") or {}
    if profile:  # checked now (unknown keys, bad steps), used by the trainer
        try:
            from mm_profiling.config import ProfileConfig
        except ImportError as e:
            raise ImportError("a profile section needs mm-profiling: pip install 'mm-train[profiling]'") from e
        ProfileConfig.from_dict(profile)
    return Recipe(profile=profile, output_dir=str(values.get("output_dir", "runs/default")), **built)


def load_recipe(path: Optional[str] = None, overrides: Sequence[str] = ()) -> Recipe:
    """The recipe at ``path`` (YAML, safe_load), or the built-in tiny default, with overrides."""
    source = Path(path) if path else Path(__file__).with_name("recipes") / "qwen2_5_vl_tiny.yaml"
    if not source.is_file():
        raise FileNotFoundError(f"no recipe at {source}")
    with open(source) as f:
        values = yaml.safe_load(f) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{source} must hold a mapping of sections, got {type(values).__name__}")
    return build_recipe(values, overrides)


def check_layout(recipe: Recipe, world_size: int) -> int:
    """Refuse a layout the world or the batch cannot hold, before any process starts; returns the
    number of micro-batches each data-parallel rank runs per step."""
    par, train = recipe.parallel, recipe.train
    model_parallel = par.tp * par.cp * par.pp
    if world_size % model_parallel:
        raise ValueError(f"{world_size} processes cannot hold tp x cp x pp = {par.tp} x {par.cp} x {par.pp} = "
                         f"{model_parallel}; use a multiple of {model_parallel} processes")
    dp = world_size // model_parallel
    per_step = train.micro_batch_size * dp
    if train.global_batch_size % per_step:
        raise ValueError(f"train.global_batch_size={train.global_batch_size} is not a multiple of micro_batch_size x "
                         f"dp = {train.micro_batch_size} x {dp}; the global batch must split into whole micro-batches")
    if par.vpp > 1 and (train.global_batch_size // per_step) % par.pp:
        raise ValueError(f"with vpp > 1 the micro-batches per step and rank ({train.global_batch_size // per_step}) "
                         f"must be a multiple of pp={par.pp} (the interleaved schedule's rule); change "
                         "global_batch_size or micro_batch_size")
    return train.global_batch_size // per_step
