"""Recipes: one YAML file per training run, typed and checked before any process starts.

    model:      family (a registered family: `mm-train recipes` lists them), path (a Hugging Face
                folder) or config (a tiny one inline), recompute, lora, freeze
    data:       kind (one of the family's data kinds), path, num_workers, max_bad_fraction and the
                fields of that kind's own typed section (mm_train.families.<wing>.<family>)
    parallel:   the fields of mm_parallel.ParallelConfig (tp, pp, vpp, cp, cp_algo, ...)
    optim:      the fields of mm_parallel.OptimizerConfig (lr, lr_schedule, warmup_steps, ...)
    train:      steps, global_batch_size | global_batch_tokens, micro_batch_size, seed, log_every,
                precision (bf16 | fp16 | fp32), grad_dtype, objective (one of the family's: sft | dpo |
                grpo for the VL families; unset: the family's first)
    dpo, grpo:  the post-training objectives' sections (train.objective dpo: preference pairs;
                grpo: rollouts and rewards; mm_train.objective_sections)
    checkpoint: every, keep, save_dtype, shared_fs
    cluster:    nodes, devices_per_node, device: where the recipe is meant to run (`mm-train plan`)
    logging:    tensorboard (event files beside metrics.jsonl), tensorboard_dir
    eval:       every, fraction / path (a held-out split), sample_every, prompts, images, ...:
                validation loss and samples while training (mm_train.evaluation, mm_train.samples)
    profile:    the fields of mm_profiling.ProfileConfig (enable, start_step, end_step, ...)
    output_dir
    ...         sections of the family's own (e.g. a diffusion objective), typed by the family

``--set section.key=value`` overrides any field (the value read as YAML: ``--set parallel.tp=2``,
``--set optim.betas=[0.9,0.95]``); a longer path reaches into a mapping field
(``--set model.config.text_config.num_hidden_layers=4``). An unknown section or key is an error naming the closest valid
one; `check_layout` refuses a layout the world size or the batch sizes cannot hold. The global batch
is a property of the run, not of the layout: micro-batches per step = global / (micro x dp), so the
losses of one recipe are comparable across layouts. A recipe is a file or the name of a built-in
one (`mm_train.registry.find_recipe`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

import yaml

from mm_train import registry
from mm_train.model_source import ModelSource
from mm_train.objective_sections import EXPONENT, OBJECTIVE_SECTIONS, DpoSection, GrpoSection, check_objective
from mm_train.trackers import SECTIONS as TRACKER_SECTIONS

# Deferred imports: MindSpore and mm-parallel (the CLI starts without loading MindSpore); mm-profiling
# (optional: a missing one is named when a run needs it).

if TYPE_CHECKING:  # the sections' classes; imported where a recipe is built (MindSpore loads with them)
    from mm_parallel import OptimizerConfig, ParallelConfig
    from mm_profiling.config import ProfileConfig


@dataclass
class LoraSection:
    """model.lora: adapters of rank ``r`` (scaled alpha / r) on ``target_modules`` (module-path
    suffixes, PEFT's; unset: the family's defaults, its plan's LoraConfig), the base model frozen."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: Optional[List[str]] = None

    def __post_init__(self):
        if self.r < 1:
            raise ValueError(f"model.lora.r must be >= 1, got {self.r}")
        if self.dropout:
            # the layers run outside MindSpore's training mode and the masks would differ between
            # layouts (no model-parallel random state yet): refused rather than silently not applied
            raise ValueError(f"model.lora.dropout={self.dropout} is not supported yet (adapter dropout is "
                             "not applied in training); set it to 0")

    def options(self) -> Dict[str, Any]:
        """The keywords of the family's LoraConfig (target_modules only when given)."""
        values = dataclasses.asdict(self)
        return values if self.target_modules is not None else {k: v for k, v in values.items()
                                                                   if k != "target_modules"}


@dataclass
class ModelSection:
    family: str = ""  # a registered family (mm_train.registry)
    path: Optional[str] = None  # a Hugging Face folder; None: build from ``config`` with random weights
    # without path: the model's config.json, inline; with path: flat values overriding the folder's
    config: Dict[str, Any] = field(default_factory=dict)
    recompute: str = "none"
    recompute_num_layers: Optional[int] = None
    lora: Optional[LoraSection] = None
    freeze: List[str] = field(default_factory=list)
    # which experts of a pipeline of several to train (e.g. high_noise | low_noise | both;
    # the family checks it, a family without experts refuses it)
    expert: Optional[str] = None

    def __post_init__(self):
        if self.path is None and not self.config:
            raise ValueError("model needs a path (a Hugging Face folder) or an inline config")
        nested = sorted(key for key, value in self.config.items() if isinstance(value, dict))
        if self.path and nested:
            raise ValueError(f"model.config {nested} are sections; beside model.path give flat overrides "
                             f"(e.g. output_router_logits: true), or drop model.path to build from an inline config")
        if isinstance(self.lora, dict):
            self.lora = _typed("model.lora", LoraSection, self.lora)

    @property
    def config_overrides(self) -> Dict[str, Any]:
        """model.config beside model.path: flat values that override the folder's config.json (a key
        the text config holds goes there, e.g. ``output_router_logits: true``)."""
        return dict(self.config) if self.path else {}


@dataclass
class DataSection:
    """The fields every data kind has; each family types the rest in a subclass per kind."""

    kind: str = ""
    path: Optional[str] = None  # the data file / folder (built-in sets: where they are generated)
    num_workers: int = 0  # data worker processes
    max_bad_fraction: float = 0.01  # skipped bad samples beyond this share of the data set stop the run
    # how data.path holds the samples: json (annotation files beside media files), or shards read a
    # block at a time — parquet | webdataset | arrow (mm_data.shards: a folder, a glob or a manifest.json)
    format: str = "json"

    def require_path(self, what: str) -> None:
        """For kinds that read the user's data: data.path must say where it is."""
        if not self.path:
            raise ValueError(f"data.kind {self.kind} needs data.path: {what}")


DATA_FORMATS = ("json", "parquet", "webdataset", "arrow")
BATCH_COUNTS = ("global_batch_size", "global_batch_tokens")  # a step counts one of them


@dataclass
class TrainSection:
    steps: int = 100
    # a step's samples, or with global_batch_tokens (packed VL data) its tokens: exactly one is set
    # (unset both: 8 samples; --set of one unsets the recipe file's other)
    global_batch_size: Optional[int] = None
    global_batch_tokens: Optional[int] = None
    micro_batch_size: int = 4
    seed: int = 0
    log_every: int = 1
    max_nonfinite_steps: int = 3  # this many skipped steps in a row (nan / inf loss or gradient) stop the run
    precision: str = "fp32"  # bf16 | fp16 | fp32: parameters and activations (mm_parallel.precision)
    grad_dtype: str = "fp32"  # what micro-batch gradients are summed in: fp32 (Megatron's main_grad) or bf16
    # a collective waiting this long during a step stops the run, naming the rank that never came (0: never)
    collective_timeout: float = 600.0
    # auto | cpu | ascend (MM_DEVICE in the environment overrides it; mm_parallel.runtime)
    device: str = "auto"
    # token: every answer token of the global batch weighs the same (Megatron's per-token loss; the
    # default with data.packing); sample: each sample's mean first; unset without packing: the mean
    # of the micro-batches' means (mm_train.loss_share)
    loss_normalization: Optional[str] = None
    # the tensors the backward needs kept in host memory between the forward and the backward
    # (mm_parallel.activation_offload): the same values, device memory for two copies a step
    activation_offload: bool = False
    # what the run learns: one of the family's objectives (FamilySpec.objectives; unset: its first),
    # e.g. sft or dpo (preference pairs, the recipe's dpo section)
    objective: Optional[str] = None

    def __post_init__(self):
        if self.global_batch_size is not None and self.global_batch_tokens is not None:
            raise ValueError("set one of train.global_batch_size (samples a step) and train.global_batch_tokens "
                             "(tokens a step), not both (--set of one on the command line unsets the other)")
        if self.global_batch_tokens is None and self.global_batch_size is None:
            self.global_batch_size = 8
        for name in ("steps", "global_batch_size", "global_batch_tokens", "micro_batch_size", "log_every",
                     "max_nonfinite_steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.collective_timeout < 0:
            raise ValueError(f"train.collective_timeout must be >= 0 seconds (0: no timeout), "
                             f"got {self.collective_timeout}")
        if self.device not in ("auto", "cpu", "ascend"):
            raise ValueError(f"train.device must be auto, cpu or ascend, got {self.device!r}")
        if self.loss_normalization not in (None, "token", "sample"):
            raise ValueError(f"train.loss_normalization must be token or sample, got {self.loss_normalization!r}")
        if self.precision not in ("bf16", "fp16", "fp32"):
            raise ValueError(f"train.precision must be bf16, fp16 or fp32, got {self.precision!r}")
        if not isinstance(self.activation_offload, bool):
            raise ValueError(f"train.activation_offload must be true or false, got {self.activation_offload!r}")
        if self.grad_dtype not in ("fp32", self.precision):
            raise ValueError(f"train.grad_dtype must be fp32 or the run's precision ({self.precision}), "
                             f"got {self.grad_dtype!r}")

    def precision_policy(self):
        """The mm_parallel.precision.Precision of this run."""
        from mm_parallel.precision import Precision

        return Precision(self.precision, self.grad_dtype)


@dataclass
class CheckpointSection:
    every: int = 0  # 0: no checkpoints
    keep: int = 2
    save_dtype: Optional[str] = None  # the model weights' dtype on disk (fp32 | bf16 | fp16); None: the run's
    # false: output_dir is on each node's own disk; each node keeps its part of every checkpoint
    # (mm_train.node_disks), and a run resumes with the layout and node order that wrote it
    shared_fs: bool = True

    def __post_init__(self):
        if self.save_dtype not in (None, "fp32", "bf16", "fp16"):
            raise ValueError(f"checkpoint.save_dtype must be fp32, bf16 or fp16 (or unset: the run's precision), "
                             f"got {self.save_dtype!r}")


@dataclass
class ClusterSection:
    """Where the recipe is meant to run (`mm-train plan`; its flags override these): ``device``
    names an entry of mm_train/plan/devices.yaml."""

    nodes: int = 1
    devices_per_node: int = 1
    device: str = "cpu"

    def __post_init__(self):
        for name in ("nodes", "devices_per_node"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int) or \
                    getattr(self, name) < 1:
                raise ValueError(f"cluster.{name} must be a whole number >= 1, got {getattr(self, name)!r}")


@dataclass
class LoggingSection:
    """What a run writes beside metrics.jsonl (mm_train.tensorboard_log, mm_train.trackers)."""

    tensorboard: bool = False  # TensorBoard event files of every logged row (needs mm-train[tensorboard])
    tensorboard_dir: Optional[str] = None  # default: output_dir/tensorboard
    # trackers (each an extra: mm-train[wandb] / [swanlab] / [mlflow]); true: the defaults
    wandb: Optional[Any] = None  # {project, name, mode: online | offline}
    swanlab: Optional[Any] = None  # {project, name, mode: cloud | local}
    mlflow: Optional[Any] = None  # {tracking_uri (default: a file store at output_dir/mlruns), experiment, name}

    def __post_init__(self):
        for name, cls in TRACKER_SECTIONS.items():
            value = getattr(self, name)
            if value is True:
                setattr(self, name, cls())
            elif value is False:
                setattr(self, name, None)
            elif isinstance(value, dict):
                setattr(self, name, _typed(f"logging.{name}", cls, value))
            elif value is not None and not isinstance(value, cls):
                raise ValueError(f"logging.{name} is a section ({', '.join(f.name for f in fields(cls))}) or true, "
                                 f"got {value!r}")


@dataclass
class EvalSection:
    """Validation while training (mm_train.evaluation) and samples to look at (mm_train.samples).

    Validation: every ``every`` steps the loss over a held-out split — ``fraction`` of the training
    set (drawn by train.seed alone, never trained on) or the data at ``path`` (same data.kind as
    the training data) — in batches of ``batch_size`` samples (default micro_batch_size x dp),
    at most ``max_batches`` of them (0: all). Samples: every ``sample_every`` steps, one per prompt
    of ``prompts`` (with ``images``: their first frames / pictures, one per prompt; VL ``videos``:
    a clip per prompt; ``audios`` (models that hear): a sound per prompt; "" where a prompt has none)."""

    every: int = 0  # steps between validation losses (0: none)
    fraction: float = 0.0  # share of the training set held out
    path: Optional[str] = None  # or a separate data file / folder of data.kind
    batch_size: Optional[int] = None
    max_batches: int = 0
    sample_every: int = 0  # steps between samples (0: none)
    prompts: List[str] = field(default_factory=list)
    negative_prompt: str = ""  # classifier-free guidance's unconditional prompt
    images: List[str] = field(default_factory=list)
    videos: List[str] = field(default_factory=list)  # VL: a clip per prompt
    audios: List[str] = field(default_factory=list)  # models that hear: a sound per prompt
    num_frames: Optional[int] = None  # video samples (default: the training clips' shape)
    height: Optional[int] = None
    width: Optional[int] = None
    steps: int = 10  # sampler steps
    guidance: float = 5.0
    sampler: str = "default"  # one of the family's samplers (default: its first; a wrong name lists them)
    seed: int = 0
    max_new_tokens: int = 32  # VL answers

    def __post_init__(self):
        for name in ("every", "max_batches", "sample_every", "steps", "max_new_tokens"):
            if getattr(self, name) < 0 or (name in ("steps", "max_new_tokens") and getattr(self, name) < 1):
                raise ValueError(f"eval.{name} must be a whole number >= {int(name in ('steps', 'max_new_tokens'))}, "
                                 f"got {getattr(self, name)}")
        if self.fraction and self.path:
            raise ValueError("eval.fraction and eval.path both give a held-out split; keep one")
        if not 0.0 <= self.fraction < 1.0:
            raise ValueError(f"eval.fraction must lie in [0, 1), got {self.fraction}")
        if self.every and not (self.fraction or self.path):
            raise ValueError("eval.every needs a held-out split: eval.fraction (e.g. 0.05) or eval.path")
        if self.sample_every and not self.prompts:
            raise ValueError("eval.sample_every needs eval.prompts: the fixed prompts samples are drawn from")
        for name in ("images", "videos", "audios"):
            if getattr(self, name) and len(getattr(self, name)) != len(self.prompts):
                raise ValueError(f"eval.{name} gives {len(getattr(self, name))} files for {len(self.prompts)} "
                                 "prompts; give one per prompt")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"eval.batch_size must be >= 1, got {self.batch_size}")

    @property
    def held_out(self) -> bool:
        return bool(self.fraction or self.path)


@dataclass
class Recipe:
    model: ModelSection
    data: DataSection  # the family's section for data.kind
    parallel: ParallelConfig
    optim: OptimizerConfig
    train: TrainSection
    checkpoint: CheckpointSection
    profile: Optional[ProfileConfig]  # None: no profile section (mm-profiling is needed only with one)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    eval: EvalSection = field(default_factory=EvalSection)
    dpo: DpoSection = field(default_factory=DpoSection)
    grpo: GrpoSection = field(default_factory=GrpoSection)
    output_dir: str = "runs/default"
    family_sections: Dict[str, Any] = field(default_factory=dict)  # the family's own sections, typed

    @property
    def model_source(self) -> ModelSource:
        """The model's config.json, read once for this recipe (mm_train.model_source)."""
        if "_model_source" not in self.__dict__:  # not a field: to_dict and comparisons leave it out
            self.__dict__["_model_source"] = ModelSource(self.model)
        return self.__dict__["_model_source"]

    def section(self, name: str):
        """The family's own section ``name`` (e.g. a diffusion family's ``diffusion``), typed."""
        if name not in self.family_sections:
            raise KeyError(f"model.family {self.model.family} has no recipe section {name!r}")
        return self.family_sections[name]

    @property
    def family(self):
        """The model family's FamilySpec (mm_train.registry)."""
        return registry.get(self.model.family)

    def to_dict(self) -> dict:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "family_sections":
                out.update({k: dataclasses.asdict(v) for k, v in value.items()})
            elif f.name in OBJECTIVE_SECTIONS and self.train.objective != f.name:
                continue  # a section of its objective only
            elif f.name == "profile":
                out[f.name] = dataclasses.asdict(value) if value is not None else {}
            else:
                out[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
        return out


GENERIC_SECTIONS = ("model", "data", "parallel", "optim", "train", "checkpoint", "cluster", "logging", "eval", "dpo",
                    "grpo", "profile", "output_dir")


def _sections(spec, data_kind: str):
    """Every section's dataclass for a recipe of family ``spec`` whose data.kind is ``data_kind``."""
    from mm_parallel import OptimizerConfig, ParallelConfig

    if data_kind not in spec.data_sections:
        raise ValueError(f"data.kind {data_kind!r} does not feed model.family {spec.name}; "
                         f"choose one of {list(spec.data_sections)}")
    return {"model": ModelSection, "data": spec.data_sections[data_kind], "parallel": ParallelConfig,
            "optim": OptimizerConfig, "train": TrainSection, "checkpoint": CheckpointSection, "cluster": ClusterSection,
            "logging": LoggingSection, "eval": EvalSection, **OBJECTIVE_SECTIONS, **spec.sections}


def _unknown(kind: str, key: str, valid: Sequence[str]) -> ValueError:
    close = difflib.get_close_matches(key, list(valid), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(sorted(valid))}"
    return ValueError(f"unknown {kind} {key!r}{hint}")


def _typed(section: str, cls, given: dict):
    """``cls(**given)``: an unknown key named with the closest valid one, numbers and flags checked."""
    names = [f.name for f in fields(cls)]
    for key in given:
        if key not in names:
            raise _unknown(f"{section} key", key, names)
    given = dict(given)
    _check_types(section, cls, given)
    return cls(**given)


def _check_types(section: str, cls, given: dict) -> None:
    """A number field given a non-number (or a flag given a non-bool) is an error naming it."""
    defaults = {f.name: f.default for f in fields(cls) if f.default is not dataclasses.MISSING}
    for key, value in given.items():
        default = defaults.get(key)
        if isinstance(default, (int, float)) and not isinstance(default, bool) and isinstance(value, str) \
                and EXPONENT.match(value):
            value = given[key] = float(value)  # YAML 1.1 reads 1e-8 (no dot) as a string
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
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as error:
        first = str(error).splitlines()[0]
        raise ValueError(f"--set {text!r}: the value is not valid YAML ({first}); quote text that holds "
                         "YAML's punctuation, e.g. \"eval.prompts=['what is it?']\"") from None
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
    known = set(GENERIC_SECTIONS) | {name for f in registry.families().values() for name in f.sections}
    for key in values:  # a misspelt section is named before the family decides which ones exist
        if key not in known:
            raise _unknown("recipe section", key, known)
    spec = _family(values, overrides)
    sections = _sections(spec, _chosen(values, overrides, "data", "kind") or next(iter(spec.data_sections)))
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
        if section == "train" and leaf in BATCH_COUNTS and value is not None:  # the command line's count wins
            target.pop(next(k for k in BATCH_COUNTS if k != leaf), None)
    built = {}
    data_format = (values.get("data") or {}).get("format", "json")
    if data_format not in DATA_FORMATS:
        raise ValueError(f"data.format {data_format!r}: use one of {', '.join(DATA_FORMATS)}")
    for name, cls in sections.items():
        given = dict(values.get(name) or {})
        if name == "optim" and "betas" in given:
            given["betas"] = tuple(given["betas"])
        if name == "data":
            given.setdefault("kind", next(k for k, c in spec.data_sections.items() if c is cls))
        built[name] = _typed(name, cls, given)
    output_dir = str(values.get("output_dir", "runs/default"))
    own = {name: built.pop(name) for name in spec.sections}
    check_objective(spec, built, {name for name in OBJECTIVE_SECTIONS if values.get(name)})
    expert = built["model"].expert
    if expert is not None and expert not in spec.experts:
        raise ValueError(f"model.expert {expert!r}: family {spec.name} " + (
            f"trains the experts {', '.join(spec.experts)}" if spec.experts else "has no experts to choose; drop it"))
    if built["train"].global_batch_tokens is not None and not getattr(built["data"], "packing", False):
        raise ValueError(f"train.global_batch_tokens counts the tokens of packed rows, and data.kind "
                         f"{built['data'].kind} of family {spec.name} does not pack: set data.packing: true where "
                         "the data section has it, or count samples with train.global_batch_size")
    return Recipe(profile=_profile(values.get("profile"), output_dir), output_dir=output_dir, family_sections=own,
                  **built)


def _profile(given: Optional[dict], output_dir: str):
    """The profile section as mm-profiling's ProfileConfig (its trace under OUT/profile unless
    save_path says), or None without one."""
    if not given:
        return None
    from mm_profiling.config import ProfileConfig  # an ImportError names the extra (mm_train.cli)

    return ProfileConfig.from_dict({"save_path": os.path.join(output_dir, "profile"), **given})


def _chosen(values: dict, overrides: Sequence[str], section: str, key: str):
    """section.key as the overrides (the last one) or else the values give it, or None."""
    chosen = (values.get(section) or {}).get(key) if isinstance(values.get(section), dict) else None
    for text in overrides:
        if text.startswith(f"{section}.{key}="):
            chosen = parse_override(text)[2]
    return chosen


def _family(values: dict, overrides: Sequence[str]):
    """The FamilySpec the recipe's model.family names (after overrides)."""
    name = _chosen(values, overrides, "model", "family")
    if not name:
        raise ValueError(f"the recipe names no model.family; choose one of {sorted(registry.families())}")
    return registry.get(str(name))


def resolve_recipe(path: Optional[str]) -> Path:
    """A recipe file: ``path`` itself, else the built-in recipe of that name; None: the default."""
    if not path:
        return registry.default_recipe()
    source = Path(path)
    if source.is_file():
        return source
    builtin = registry.find_recipe(path)
    if builtin is not None and builtin.is_file():
        return builtin
    raise FileNotFoundError(f"no recipe file {path} and no built-in recipe of that name; `mm-train recipes` lists "
                            "the built-in ones")


def load_recipe(path: Optional[str] = None, overrides: Sequence[str] = ()) -> Recipe:
    """The recipe at ``path`` (a YAML file, safe_load, or a built-in recipe's name; None: the
    built-in default), with overrides."""
    source = resolve_recipe(path)
    with open(source) as f:  # a checkpoint's recipe.json is read as JSON (YAML would differ on 1e-08)
        values = (json.load(f) if str(source).endswith(".json") else yaml.safe_load(f)) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{source} must hold a mapping of sections, got {type(values).__name__}")
    return build_recipe(values, overrides)


def _check_hybrid_sharding(par, world_size: int, dp: int) -> None:
    """zero3_shard node needs ZeRO-3 and more than one rank of a gradient group on a node (rank
    0's dp x cp group is ranks 0, tp, 2 tp, ...: mm_parallel.topology)."""
    if par.zero_stage != 3:
        raise ValueError(f"parallel.zero3_shard=node shards ZeRO-3's weights inside each node; it needs "
                         f"parallel.zero_stage 3, not {par.zero_stage} (or leave zero3_shard at all)")
    per_node = par.ranks_per_node or world_size
    if min(dp * par.cp, -(-per_node // par.tp)) == 1:
        raise ValueError(f"parallel.zero3_shard=node: each node of {per_node} ranks holds one data- or context-"
                         f"parallel rank at tp={par.tp}, so nothing would be sharded; use zero3_shard=all, a "
                         "smaller tp or more ranks per node")


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
    if par.zero_stage == 3 and dp * par.cp == 1:
        raise ValueError(f"parallel.zero_stage 3 cuts the weights over the data- and context-parallel ranks, and "
                         f"{world_size} processes at tp x cp x pp = {model_parallel} leave one: run more processes or "
                         "use zero_stage 0")
    if par.zero3_shard == "node":
        _check_hybrid_sharding(par, world_size, dp)
    if recipe.eval.every and (recipe.eval.batch_size or per_step) % per_step:
        raise ValueError(f"eval.batch_size={recipe.eval.batch_size} is not a multiple of micro_batch_size x dp = "
                         f"{train.micro_batch_size} x {dp}; validation batches must split into whole micro-batches")
    if train.global_batch_tokens is not None:  # packed rows under a token budget: their number is free
        return 1
    if train.global_batch_size % per_step:
        raise ValueError(f"train.global_batch_size={train.global_batch_size} is not a multiple of micro_batch_size x "
                         f"dp = {train.micro_batch_size} x {dp}; the global batch must split into whole micro-batches")
    if par.vpp > 1 and (train.global_batch_size // per_step) % par.pp:
        raise ValueError(f"with vpp > 1 the micro-batches per step and rank ({train.global_batch_size // per_step}) "
                         f"must be a multiple of pp={par.pp} (the interleaved schedule's rule); change "
                         "global_batch_size or micro_batch_size")
    return train.global_batch_size // per_step
