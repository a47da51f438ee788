"""from_pretrained / save_pretrained for Wan: diffusers folders in, diffusers folders out.

A folder is config.json plus ``diffusion_pytorch_model.safetensors`` or its index with shards
(the released 14B checkpoints are sharded). Each rank reads only its tensor-parallel slice and its
pipeline stage's blocks; saving gathers the slices and writes one file per virtual stage and an
index, which diffusers' ``WanTransformer3DModel.from_pretrained`` loads unchanged.
"""

from __future__ import annotations

import re
from typing import Optional

from mm_parallel.hf_checkpoint import load_weights, save_folder
from mm_parallel.topology import Topology

from mm_models_video.wan.config import WanTransformerConfig

WEIGHTS = "diffusion_pytorch_model.safetensors"
_BLOCK = re.compile(r"^blocks\.(\d+)\.")


def global_name(model, name: str) -> str:
    """A module or parameter path with this pipeline stage's block numbers made the model's."""
    if not model.layer_offset:
        return name
    return _BLOCK.sub(lambda m: f"blocks.{int(m.group(1)) + model.layer_offset}.", name + ".")[:-1]


def checkpoint_name(model, name: str) -> Optional[str]:
    """diffusers' name of a parameter (LoRA's wrapped base weights under their own name; the
    adapters are not part of model checkpoints)."""
    if ".lora_A" in name or ".lora_B" in name:
        return None
    return global_name(model, name.replace(".base_layer.", "."))


def from_pretrained(cls, path, topology: Optional[Topology] = None, chunk: int = 0, pipeline_num_layers=None,
                    **overrides):
    values = WanTransformerConfig.load(path).to_dict()
    values.update(overrides)
    model = cls(WanTransformerConfig.from_dict(values), topology, chunk=chunk, pipeline_num_layers=pipeline_num_layers)
    load_weights(model, str(path), lambda name: checkpoint_name(model, name))
    return model


def save_pretrained(models, path) -> None:
    """Write config.json and the weights in diffusers' layout; every rank calls it. ``models``:
    the model, or the list of chunks a pipeline rank holds (see hf_checkpoint.save_folder)."""
    first = models[0] if isinstance(models, (list, tuple)) else models
    save_folder(models, path, checkpoint_name, first.config.save, base=WEIGHTS)
