"""The family registry: one `FamilySpec` per model family, so the trainer never names a model.

A family is what a recipe's ``model.family`` names: its model classes (by the Hugging Face
``model_type`` / diffusers ``_class_name`` of their config.json, which is also how ``mm-train
convert`` recognises a folder), its training task, its data kinds with their typed data
sections, any recipe sections of its own, its parallel plan and LoRA defaults, and its built-in
recipes. The CLI, recipes, convert and the loop ask the registry; a new family is one module that
calls `register` (plus its model package and recipes). This module imports nothing else of
mm-train: it is the bottom of the package, and the families sit above everything generic.

Commands of the family wing (`mm-train import`: other tools' configurations, which name models)
come the same way, from the ``mm_train.commands`` entry point group (each a `CommandSpec`), so the
CLI adds them without naming them.

Where families come from, in order: the ``mm_train.families`` entry point group of installed
packages (each entry point a FamilySpec; mm-train's own pyproject.toml lists the built-in ones of
its family wing, ``mm_train.families.video`` and ``mm_train.families.vl``); then the modules listed
in ``$MM_TRAIN_FAMILIES`` (comma-separated, imported: each registers its own).

A spec holds objects (the task class, the preflight, workload, processing and generate
functions). Only what lives in an optional model package is named by a "module:attribute"
string (the model classes, the plan, the LoRA config), imported on use: the registry loads
without the model packages (mm-train's extras), and a missing one is an error naming the extra to
install.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

ENTRY_POINT_GROUP = "mm_train.families"
COMMAND_GROUP = "mm_train.commands"
RECIPE_FOLDER = Path(__file__).resolve().parent / "recipes"


def resolve(reference: str, extra: Optional[str] = None):
    """The object a "module:attribute" reference names (imported now)."""
    module, _, attribute = reference.partition(":")
    try:
        return getattr(importlib.import_module(module), attribute)
    except ImportError as error:  # the missing module's name kept: the CLI names the extra from it
        hint = f"; install it with pip install 'mm-train[{extra}]'" if extra else ""
        raise ImportError(f"{reference} cannot be imported ({error}){hint}", name=error.name) from error


@dataclass(frozen=True)
class BuiltinRecipe:
    """A recipe shipped with a family: ``mm-train run NAME`` finds it."""

    name: str
    file: str  # relative to mm_train/recipes, or absolute
    trains: str  # what it trains, one line
    machines: str  # what it is written for ("1-2 CPU processes", "1 x 8 Ascend 910B")
    default: bool = False  # the recipe `mm-train run` trains without one (one in all)

    @property
    def path(self) -> Path:
        return Path(self.file) if os.path.isabs(self.file) else RECIPE_FOLDER / self.file


@dataclass(frozen=True)
class FamilySpec:
    """Everything the generic trainer needs to know of a family (see the module docstring)."""

    name: str  # the recipe's model.family
    description: str
    models: Dict[str, str]  # config.json model_type / _class_name -> "module:Class"; the first is the default
    task: type  # the training task (mm_train.task.Task), made with (recipe, topology)
    data_sections: Dict[str, type]  # data.kind -> its typed data section; the first kind is the default
    plan: str  # "module:function": parallelize(model, recompute=, recompute_num_layers=, lora=, [freeze=])
    lora_config: str  # "module:Class": the LoRA config with the family's default target modules
    extra: str  # the pip extra of mm-train that installs the model package
    sections: Dict[str, type] = field(default_factory=dict)  # recipe sections of this family only
    recipes: Tuple[BuiltinRecipe, ...] = ()
    # (recipe, folder) -> [files]: what a model folder needs beside its weights (tokenizer, chat
    # template, processor configs) as the run used them; `convert checkpoint` calls it
    processing: Optional[Callable] = None
    # (recipe, config.json mapping) -> [problems]: the layout against the model's shapes and the
    # data's files, checked before launch (mm_train.preflight)
    preflight: Optional[Callable] = None
    # (recipe, model config) -> mm_train.plan.workload.Workload: the shapes and FLOPs of one sample
    # for `mm-train plan`
    workload: Optional[Callable] = None
    # (args, spec, folder, recipe, topology, model chunks) -> {what was made}: `mm-train generate`
    generate: Optional[Callable] = None
    # train.objective values the family trains (mm_train.recipe.TrainSection); the first is the default
    objectives: Tuple[str, ...] = ("sft",)
    # model.expert values (a pipeline of several denoisers switched by noise level); empty: none
    experts: Tuple[str, ...] = ()
    # (recipe, config.json mapping) -> the model class, where the recipe decides it (a pipeline's experts)
    choose_model: Optional[Callable] = None

    def model_class(self, config: Optional[dict] = None):
        """The model class of a config.json mapping (the pipeline's _class_name when it came from a
        diffusers pipeline folder and the family names it, else its model_type / _class_name), else
        the default."""
        config = config or {}
        pipeline = (config.get(PIPELINE_KEY) or {}).get("_class_name")
        key = pipeline if pipeline in self.models else config.get("model_type") or config.get("_class_name")
        return resolve(self.models.get(key, next(iter(self.models.values()))), self.extra)

    def recipe_model_class(self, recipe, config: Optional[dict] = None):
        """The model class a recipe trains: the family's choice (``choose_model``), else `model_class`."""
        return self.choose_model(recipe, config or {}) if self.choose_model else self.model_class(config)

    def plan_function(self) -> Callable:
        """The model package's ``parallelize`` (imported now)."""
        return resolve(self.plan, self.extra)

    def lora_config_class(self) -> type:
        """The model package's LoRA config class (imported now)."""
        return resolve(self.lora_config, self.extra)


_REGISTRY: Dict[str, FamilySpec] = {}
PIPELINE_KEY = "_pipeline"  # a pipeline folder's model_index.json, beside its denoiser's config
DENOISERS = ("transformer", "transformer_2")  # diffusers' names of a pipeline's denoisers
_discovered = False


def register(spec: FamilySpec) -> FamilySpec:
    """Add a family (a module's import calls it); a second family of one name is an error."""
    known = _REGISTRY.get(spec.name)
    if known is not None and known != spec:
        raise ValueError(f"model family {spec.name!r} is registered twice")
    defaults = [r.name for f in _REGISTRY.values() for r in f.recipes if r.default and f.name != spec.name]
    if defaults and any(r.default for r in spec.recipes):
        raise ValueError(f"family {spec.name!r} marks a default recipe; {defaults[0]} is already the default")
    _REGISTRY[spec.name] = spec
    return spec


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    _discovered = True
    for point in entry_points(group=ENTRY_POINT_GROUP):
        register(point.load())
    for module in filter(None, (m.strip() for m in os.environ.get("MM_TRAIN_FAMILIES", "").split(","))):
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise ValueError(f"$MM_TRAIN_FAMILIES names {module!r}, which cannot be imported ({error}); put its "
                             "folder on PYTHONPATH or install its package") from error


@dataclass(frozen=True)
class CommandSpec:
    """A subcommand the family wing adds to `mm-train`: its name, its parser (``add_parser(subparsers)``)
    and what it does (``run(args) -> exit status``)."""

    name: str
    add_parser: Callable[[Any], None]
    run: Callable[[Any], int]


_COMMANDS: Dict[str, CommandSpec] = {}


def commands() -> Dict[str, CommandSpec]:
    """The wing's subcommands by name (the ``mm_train.commands`` entry points, read once: the CLI asks
    when it builds its parser and again when it dispatches)."""
    if not _COMMANDS:
        for point in entry_points(group=COMMAND_GROUP):
            spec = point.load()
            if spec.name in _COMMANDS:
                raise ValueError(f"mm-train command {spec.name!r} is registered twice")
            _COMMANDS[spec.name] = spec
    return dict(_COMMANDS)


def families() -> Dict[str, FamilySpec]:
    """Every registered family by name."""
    _discover()
    return dict(_REGISTRY)


def get(name: str) -> FamilySpec:
    """The family a recipe names; an unknown name is an error listing the known ones."""
    known = families()
    if name not in known:
        raise ValueError(f"model.family {name!r} is not available; choose one of {sorted(known)}")
    return known[name]


def recipes() -> List[Tuple[FamilySpec, BuiltinRecipe]]:
    """Every built-in recipe with its family, in registration order."""
    return [(spec, recipe) for spec in families().values() for recipe in spec.recipes]


def find_recipe(name: str) -> Optional[Path]:
    """The file of the built-in recipe ``name`` (with or without .yaml), or None."""
    stem = name[:-5] if name.endswith(".yaml") else name
    return next((r.path for _, r in recipes() if r.name == stem), None)


def default_recipe() -> Path:
    """The recipe `mm-train run` trains when given none."""
    found = [r for _, r in recipes() if r.default]
    if not found:
        raise ValueError("no family marks a default recipe; give a recipe")
    return found[0].path


def read_model_config(folder: str) -> Tuple[str, dict]:
    """(the file, its mapping) of a model folder's config.json; for a diffusers pipeline folder
    (model_index.json) its denoiser's — the first of DENOISERS it holds — with model_index.json's
    mapping under PIPELINE_KEY (the pipeline's settings and components)."""
    path = os.path.join(folder, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            return path, json.load(f)
    index = os.path.join(folder, "model_index.json")
    if not os.path.isfile(index):
        raise FileNotFoundError(f"{folder} has no config.json: give a Hugging Face / diffusers model folder (or a "
                                "diffusers pipeline folder with its model_index.json)")
    with open(index) as f:
        pipeline = json.load(f)
    for name in DENOISERS:  # listed as [null, null]: absent; else there if its folder is
        path = os.path.join(folder, name, "config.json")
        if (pipeline.get(name) or ["unlisted"])[0] is not None and os.path.isfile(path):
            with open(path) as f:
                return path, {**json.load(f), PIPELINE_KEY: pipeline}
    raise FileNotFoundError(f"the pipeline folder {folder} holds none of {DENOISERS} with a config.json")



def _family_of(path: str, config: dict) -> FamilySpec:
    keys = {config.get("model_type"), config.get("_class_name")} - {None}
    for spec in families().values():
        if keys & set(spec.models):
            return spec
    known = sorted(k for spec in families().values() for k in spec.models)
    raise ValueError(f"{path} describes {sorted(keys) or 'an unknown model'}; the registered families know {known}")


def model_class_of(folder: str):
    """The model class that loads a Hugging Face / diffusers folder."""
    path, config = read_model_config(folder)
    return _family_of(path, config).model_class(config)


def family_of(folder: str) -> FamilySpec:
    """The family whose model a Hugging Face / diffusers folder holds."""
    return _family_of(*read_model_config(folder))
