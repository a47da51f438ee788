"""WanExperts: the denoisers of a Wan2.2 diffusers pipeline folder as one model.

A Wan2.2 A14B pipeline holds two WanTransformer3DModels of one architecture (diffusers'
WanPipeline / WanImageToVideoPipeline docstring):

    transformer     the high-noise expert, used for timesteps t >= boundary_ratio x num_train_timesteps
    transformer_2   the low-noise expert, used below
and TI2V-5B holds ``transformer`` alone (``expand_timesteps``: per-token timesteps, the clean
first frame's at 0). `from_pretrained` reads the pipeline folder (model_index.json and the expert
subfolders) or a checkpoint written by `save_pretrained` (the same layout, so diffusers' pipeline
and resuming read it alike), holding the experts ``expert`` names: "high_noise", "low_noise" or
"both" (None: every expert the folder has). Each expert is built under the same layout (its own
pipeline stage of blocks, tp / cp shards); a forward (or a pipeline stage) runs the expert its
timesteps choose, all of a micro-batch's on one side of the boundary. The expert a micro-batch
does not use gets zero gradients, so data-parallel ranks whose micro-batches chose different
experts still reduce every parameter together.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

import numpy as np
from mindspore import nn

from mm_models_video.diffusers_config import DIFFUSERS_VERSION
from mm_models_video.wan.modeling import WanTransformer3DModel
from mm_parallel.ops.device import host_array as host
from mm_parallel.topology import Topology, get_topology

HIGH, LOW = "transformer", "transformer_2"  # diffusers' component names
EXPERTS = {"high_noise": (HIGH,), "low_noise": (LOW,), "both": (HIGH, LOW)}
PIPELINE_FILE = "model_index.json"


def read_pipeline(path) -> dict:
    """A diffusers pipeline folder's model_index.json."""
    file = os.path.join(str(path), PIPELINE_FILE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path} has no {PIPELINE_FILE}: give a Wan2.2 diffusers pipeline folder")
    with open(file) as f:
        return json.load(f)


def pipeline_experts(pipeline: dict, path=None) -> List[str]:
    """The expert components a pipeline holds: those model_index.json lists (not as [null, null]);
    with the folder's ``path``, those it leaves unlisted whose sub-folder is there too."""
    def held(name):
        listed = pipeline.get(name)
        if listed is not None:
            return listed[0] is not None
        return path is not None and os.path.isfile(os.path.join(str(path), name, "config.json"))

    return [name for name in (HIGH, LOW) if held(name)]


class WanExperts(nn.Cell):
    """See the module docstring. Built like a model class, ``(config, topology, chunk)``: every
    expert ``expert`` names with random weights from the one config (a recipe's inline config),
    or from ``experts`` ({component name: its WanTransformer3DModel, built under one topology}).
    ``pipeline``: model_index.json's fields (boundary_ratio, expand_timesteps, _class_name ...)."""

    _keep_in_fp32_modules = WanTransformer3DModel._keep_in_fp32_modules
    expert: Optional[str] = None  # what a folder gives (`choosing` sets it; None: all it has)
    components: tuple = (HIGH, LOW)  # what a model built from a config holds (`choosing` sets it)
    pipeline_fields: dict = {}  # model_index.json's fields for a model built from a config (`choosing`)
    num_train_timesteps = 1000  # the boundary is boundary_ratio x this (the scheduler's)

    def __init__(self, config=None, topology: Optional[Topology] = None, chunk: int = 0, pipeline_num_layers=None,
                 experts: Optional[Dict[str, WanTransformer3DModel]] = None, pipeline: Optional[dict] = None):
        super().__init__()
        if experts is None:
            config = self.load_config(config)
            stage = dict(chunk=chunk, pipeline_num_layers=pipeline_num_layers)
            experts = {name: WanTransformer3DModel(config, topology, **stage) for name in self.components}
        pipeline = dict(self.pipeline_fields if pipeline is None else pipeline)
        if not experts or set(experts) - {HIGH, LOW}:
            raise ValueError(f"WanExperts holds {HIGH} and / or {LOW}, got {sorted(experts)}")
        shapes = {name: model.config.to_dict() for name, model in experts.items()}
        if len({json.dumps(s, sort_keys=True, default=str) for s in shapes.values()}) > 1:
            raise ValueError(f"the experts' configs differ: {shapes}")
        for name, model in experts.items():
            setattr(self, name, model)
        self.names = [name for name in (HIGH, LOW) if name in experts]
        self.pipeline = dict(pipeline)
        ratio = self.pipeline.get("boundary_ratio")
        if len(self.names) > 1 and ratio is None:
            raise ValueError("two experts need the pipeline's boundary_ratio (model_index.json, or "
                             "diffusion.boundary_ratio for a model built from a config)")
        self.boundary = None if ratio is None else float(ratio) * self.num_train_timesteps
        first = experts[self.names[0]]
        self.config, self.topology, self.chunk = first.config, first.topology, first.chunk
        self.is_first, self.is_last = first.is_first, first.is_last

    @classmethod
    def choosing(cls, expert: Optional[str], pipeline: Optional[dict] = None, num_train_timesteps: int = 1000,
                 components: Optional[tuple] = None) -> type:
        """This class holding only the experts ``expert`` names (high_noise | low_noise | both;
        None: a folder's all); ``pipeline``: model_index.json's fields and ``components`` (default
        the expert's, or both) the experts of models built from a config."""
        if expert is not None and expert not in EXPERTS:
            raise ValueError(f"model.expert {expert!r} is not one of {sorted(EXPERTS)}")
        built = tuple(components or EXPERTS[expert or "both"])
        return type(cls.__name__, (cls,), {"expert": expert, "pipeline_fields": dict(pipeline or {}),
                                           "num_train_timesteps": num_train_timesteps, "components": built})

    @classmethod
    def load_config(cls, config, overrides=None):
        return WanTransformer3DModel.load_config(config, overrides)

    @property
    def experts(self) -> List[WanTransformer3DModel]:
        return [getattr(self, name) for name in self.names]

    def missing(self) -> List[str]:
        """The pipeline's experts this model neither holds nor borrowed (`borrow`)."""
        if self.boundary is None:
            return []
        return [name for name in (HIGH, LOW) if name not in self.names and getattr(self, name, None) is None]

    def borrow(self, name: str, model: WanTransformer3DModel) -> None:
        """Sample with ``model`` as the expert ``name`` this model does not train (a one-expert
        run's validation samples and generation): frozen, neither planned, saved nor counted as
        this model's (``names`` keeps the trained ones)."""
        if name in self.names:
            raise ValueError(f"{name} is one of this model's own experts")
        for parameter in model.get_parameters():
            parameter.requires_grad = False
        setattr(self, name, model)

    # -- the expert of a micro-batch -------------------------------------------------------------

    def expert_name(self, timestep) -> str:
        """The component whose range holds every one of ``timestep``'s values."""
        t = host(timestep, np.float32).reshape(-1)
        if self.boundary is None:
            return self.names[0]
        high = t >= self.boundary
        if high.any() and not high.all():
            raise ValueError(f"a micro-batch's timesteps straddle the experts' boundary {self.boundary:g}: "
                             f"{sorted(set(t.tolist()))}; draw each micro-batch's timesteps on one side")
        name = HIGH if high.all() else LOW
        if getattr(self, name, None) is None:
            side = "at or above" if name == HIGH else "below"
            raise ValueError(f"timesteps {side} the boundary {self.boundary:g} need the {name} expert, which this "
                             f"model does not hold (it holds {self.names})")
        return name

    def construct(self, hidden_states, timestep, *args, **kwargs):
        return getattr(self, self.expert_name(timestep))(hidden_states, timestep, *args, **kwargs)

    def pipeline_stage(self, x, batch: dict):
        return getattr(self, self.expert_name(batch["timestep"])).pipeline_stage(x, batch)

    def pipeline_loss(self, tokens, batch: dict):
        return getattr(self, self.expert_name(batch["timestep"])).pipeline_loss(tokens, batch)

    def pipeline_sample(self, tokens, batch: dict):
        return getattr(self, self.expert_name(batch["timestep"])).pipeline_sample(tokens, batch)

    def flops(self, batch: dict) -> float:
        return self.experts[0].flops(batch)

    def global_name(self, name: str) -> str:
        """A parameter path with the expert's layers numbered as in its whole model."""
        component, _, rest = name.partition(".")
        return f"{component}.{getattr(self, component).global_name(rest)}" if component in self.names else name

    def adapter_name(self, model, name: str) -> str:
        return self.global_name(name)

    # -- folders ---------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path, topology: Optional[Topology] = None, chunk: int = 0, pipeline_num_layers=None,
                        **overrides):
        """The experts ``cls.expert`` names (None: every one the folder has) from a pipeline folder
        or a checkpoint of one; other keywords override the experts' config values."""
        pipeline = read_pipeline(path)
        present = pipeline_experts(pipeline, path)
        wanted = list(EXPERTS[cls.expert]) if cls.expert else present
        missing = [name for name in wanted if name not in present]
        if missing:
            raise ValueError(f"{path} holds the experts {present}; model.expert {cls.expert} needs {missing}")
        topology = get_topology(topology)
        experts = {name: WanTransformer3DModel.from_pretrained(os.path.join(str(path), name), topology, chunk=chunk,
                                                               pipeline_num_layers=pipeline_num_layers, **overrides)
                   for name in wanted}
        return cls(experts=experts, pipeline={**pipeline, **cls.pipeline_fields})

    def save_pretrained(self, path, chunks=None, dtype=None, folder_writer: Optional[bool] = None) -> None:
        """Each expert's diffusers folder under its component name, and a model_index.json naming
        them with the source pipeline's settings (its other components are not written: diffusers'
        pipeline takes them from the model folder, ``WanPipeline.from_pretrained(checkpoint, vae=...,
        text_encoder=..., tokenizer=..., scheduler=...)``)."""
        chunks = list(chunks) if chunks else [self]
        for name in self.names:
            getattr(self, name).save_pretrained(os.path.join(str(path), name), [getattr(c, name) for c in chunks],
                                                dtype, folder_writer)
        if get_topology(self.topology).rank == 0 if folder_writer is None else folder_writer:
            settings = {k: v for k, v in self.pipeline.items() if not isinstance(v, list) and not k.startswith("_")}
            index = {"_class_name": self.pipeline.get("_class_name", "WanPipeline"),
                     "_diffusers_version": DIFFUSERS_VERSION, **settings}
            for name in (HIGH, LOW):
                index[name] = ["diffusers", "WanTransformer3DModel"] if name in self.names else [None, None]
            with open(os.path.join(str(path), PIPELINE_FILE), "w") as f:
                json.dump(index, f, indent=2)

    def load_adapter(self, path):
        """PEFT adapters of each expert from ``path/<component>``."""
        for name in self.names:
            getattr(self, name).load_adapter(os.path.join(str(path), name))

    def save_adapter(self, path, lora, chunks=None, folder_writer: Optional[bool] = None):
        """Each expert's PEFT adapters under ``path/<component>`` (diffusers loads the low-noise
        expert's with ``load_into_transformer_2``)."""
        chunks = list(chunks) if chunks else [self]
        for name in self.names:
            getattr(self, name).save_adapter(os.path.join(str(path), name), lora, [getattr(c, name) for c in chunks],
                                             folder_writer)
