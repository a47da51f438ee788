"""from_pretrained / save_pretrained for Qwen2.5-VL: transformers folders in, transformers folders out.

Parameter paths are transformers 5's module names (``model.language_model.*``, ``model.visual.*``).
On disk transformers 5.24 still writes the layout of the released Qwen2.5-VL weights
(``model.layers.*``, ``model.embed_tokens.*``, ``visual.*``) and reads both; so do we.
Each rank reads only its tensor-parallel shard and its pipeline stage's layers.
"""

from __future__ import annotations

import os
import re
from typing import Optional, Tuple

from mm_parallel import comm
from mm_parallel.hf_checkpoint import full_state, load_weights, write_weights
from mm_parallel.topology import Topology, get_topology

from mm_models_vl.qwen2_5_vl.modeling import load_config

_LAYER = re.compile(r"^model\.language_model\.layers\.(\d+)\.")


def checkpoint_name(model, name: str) -> Optional[str]:
    """transformers 5 name of a parameter path (decoder layers renumbered from this stage's offset;
    LoRA's wrapped base weights under their own name, the adapters not in model checkpoints)."""
    if ".lora_A" in name or ".lora_B" in name:
        return None
    name = name.replace(".base_layer.", ".")
    offset = model.model.language_model.layer_offset
    if offset:
        name = _LAYER.sub(lambda m: f"model.language_model.layers.{int(m.group(1)) + offset}.", name)
    return name


def disk_name(name: str) -> str:
    """The on-disk (released checkpoint) form of a module name: ``model.X`` / ``visual.X``."""
    if name.startswith("model.language_model."):
        return name.replace("model.language_model.", "model.", 1)
    return name.replace("model.visual.", "visual.", 1)


def candidate_names(model, name: str) -> Tuple[str, ...]:
    """The on-disk name, then the module name (both layouts are found in the wild)."""
    new = checkpoint_name(model, name)
    if new is None:
        return None
    return (disk_name(new), new) if disk_name(new) != new else (new,)


def from_pretrained(cls, path, topology: Optional[Topology] = None, **overrides):
    config = load_config(path)
    for key, value in overrides.items():
        target = config.text_config if hasattr(config.text_config, key) and not hasattr(config, key) else config
        setattr(target, key, value)
    model = cls(config, topology)
    load_weights(model, str(path), lambda name: candidate_names(model, name))
    return model


def save_pretrained(model, path) -> None:
    """Gather the tp shards and write config.json + model.safetensors (rank 0 writes; all ranks call)."""
    topo = get_topology(model.topology)
    state = full_state(model, lambda name: None if checkpoint_name(model, name) is None else
                       disk_name(checkpoint_name(model, name)))
    if topo.rank == 0:
        os.makedirs(path, exist_ok=True)
        model.config.save_pretrained(str(path))
        write_weights(state, str(path))
    if topo.world_size > 1:
        comm.barrier(topo.world)  # nobody reads the folder before it is complete
