"""from_pretrained / save_pretrained for Qwen2.5-VL: transformers folders in, transformers folders out.

Parameter paths are transformers 5's module names (``model.language_model.*``, ``model.visual.*``).
On disk transformers 5.24 still writes the layout of the released Qwen2.5-VL weights
(``model.layers.*``, ``model.embed_tokens.*``, ``visual.*``) and reads both; so do we.
Each rank reads only its tensor-parallel shard and its pipeline stage's layers.
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

from mm_parallel.hf_checkpoint import load_weights, save_folder
from mm_parallel.topology import Topology

from mm_models_vl.qwen2_5_vl.modeling import load_config

_LAYER = re.compile(r"^model\.language_model\.layers\.(\d+)\.")


def global_name(model, name: str) -> str:
    """A module or parameter path with this pipeline stage's layer numbers made the model's."""
    offset = model.model.language_model.layer_offset
    if not offset:
        return name
    return _LAYER.sub(lambda m: f"model.language_model.layers.{int(m.group(1)) + offset}.", name + ".")[:-1]


def checkpoint_name(model, name: str) -> Optional[str]:
    """transformers 5 name of a parameter path (decoder layers numbered as in the whole model;
    LoRA's wrapped base weights under their own name, the adapters not in model checkpoints)."""
    if ".lora_A" in name or ".lora_B" in name:
        return None
    return global_name(model, name.replace(".base_layer.", "."))


def disk_name(name: str) -> str:
    """The on-disk (released checkpoint) form of a module name: ``model.X`` / ``visual.X``."""
    if name.startswith("model.language_model."):
        return name.replace("model.language_model.", "model.", 1)
    return name.replace("model.visual.", "visual.", 1)


def _disk_checkpoint_name(model, name: str) -> Optional[str]:
    """The on-disk name a parameter is saved under (None: not in model checkpoints)."""
    name = checkpoint_name(model, name)
    return None if name is None else disk_name(name)


def candidate_names(model, name: str) -> Tuple[str, ...]:
    """The on-disk name, then the module name (both layouts are found in the wild)."""
    new = checkpoint_name(model, name)
    if new is None:
        return None
    return (disk_name(new), new) if disk_name(new) != new else (new,)


def from_pretrained(cls, path, topology: Optional[Topology] = None, chunk: int = 0, pipeline_num_layers=None,
                    **overrides):
    config = load_config(path)
    for key, value in overrides.items():
        target = config.text_config if hasattr(config.text_config, key) and not hasattr(config, key) else config
        setattr(target, key, value)
    model = cls(config, topology, chunk=chunk, pipeline_num_layers=pipeline_num_layers)
    load_weights(model, str(path), lambda name: candidate_names(model, name))
    return model


def save_pretrained(models, path) -> None:
    """Write config.json and the weights in transformers' on-disk layout; every rank calls it.
    ``models``: the model, or the list of chunks a pipeline rank holds (see hf_checkpoint.save_folder)."""
    first = models[0] if isinstance(models, (list, tuple)) else models
    save_folder(models, path, _disk_checkpoint_name, first.config.save_pretrained)
