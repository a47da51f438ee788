"""Expert weights on disk: the three layouts users have, recognised by key names and shapes.

    fused              transformers' in-memory layout   experts.gate_up_proj (E, 2I, H), experts.down_proj (E, H, I)
    fused_transposed   the hub's Qwen3-VL-MoE files      experts.gate_up_proj (E, H, 2I), experts.down_proj (E, I, H)
    per_expert         Qwen2/3-MoE files, Megatron       experts.{e}.gate_proj.weight (I, H), .up_proj (I, H),
                                                         .down_proj (H, I)

A rank reads only its experts (and under expert tensor parallelism only its rows of I) from any
of them. When 2I = H the two fused layouts have the same shapes; the file is then read as
``fused``, as transformers does (its loader transposes only on a shape mismatch). Saving writes
the layout the weights were read in, or the one set in ``GroupedExperts.save_layout``;
`convert_folder` rewrites a folder from one layout to another without building a model.
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict, Optional, Tuple

import numpy as np

LAYOUTS = ("fused", "fused_transposed", "per_expert")
_PER_EXPERT = {"gate": "gate_proj.weight", "up": "up_proj.weight", "down": "down_proj.weight"}


def memory_shapes(num_experts: int, hidden: int, intermediate: int) -> Dict[str, Tuple[int, ...]]:
    return {"gate_up_proj": (num_experts, 2 * intermediate, hidden), "down_proj": (num_experts, hidden, intermediate)}


def detect_layout(folder, prefix: str, attr: str, num_experts: int, hidden: int, intermediate: int) -> str:
    """Which layout ``folder`` (a SafetensorsFolder) stores the ``prefix`` experts in."""
    key, want = prefix + attr, memory_shapes(num_experts, hidden, intermediate)[attr]
    if key in folder:
        shape = folder.shape(key)
        if shape == want:
            return "fused"
        if shape == (want[0], want[2], want[1]):
            return "fused_transposed"
        raise ValueError(f"{key}: shape {shape} is neither {want} (fused) nor {(want[0], want[2], want[1])} "
                         f"(transposed); does config.json match the weights?")
    if prefix + "0." + _PER_EXPERT["down"] in folder:
        return "per_expert"
    raise KeyError(f"{key} is missing from the checkpoint at {folder.path}, and so are per-expert keys "
                   f"({prefix}0.gate_proj.weight ...)")


def read_local(folder, prefix: str, attr: str, experts) -> Tuple[np.ndarray, str]:
    """This rank's slice of ``experts.<attr>`` in the in-memory layout, and the layout on disk."""
    from mm_parallel.sharding import sharding_of

    param = getattr(experts, attr)
    full = memory_shapes(experts.num_experts, experts.hidden, experts.intermediate)[attr]
    layout = detect_layout(folder, prefix, attr, experts.num_experts, experts.hidden, experts.intermediate)
    index = sharding_of(param).local_index(full, experts.topology)
    if layout == "fused":
        return folder.read(prefix + attr, index), layout
    if layout == "fused_transposed":
        return folder.read(prefix + attr, (index[0], index[2], index[1])).transpose(0, 2, 1), layout
    first = experts.first
    rows = np.arange(full[1])[index[1]]  # this rank's rows of dim 1 (gate_up: gate rows then up rows)
    columns = np.arange(full[2])[index[2]]  # down_proj: this rank's columns of I
    stacked = []
    for e in range(first, first + experts.local):
        name = prefix + f"{e}."
        if attr == "down_proj":
            stacked.append(folder.read(name + _PER_EXPERT["down"], (slice(None), columns)))
        else:
            i = experts.intermediate
            gate = folder.read(name + _PER_EXPERT["gate"], rows[rows < i])  # (rows, H): every column
            up = folder.read(name + _PER_EXPERT["up"], rows[rows >= i] - i)
            stacked.append(np.concatenate([gate, up], 0))
    return np.stack(stacked), layout


def disk_tensors(prefix: str, attr: str, full: np.ndarray, layout: str) -> Dict[str, np.ndarray]:
    """The tensors ``layout`` stores for the whole ``experts.<attr>`` (in-memory layout ``full``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"expert layout {layout!r} is unknown; use one of {', '.join(LAYOUTS)}")
    if layout == "fused":
        return {prefix + attr: full}
    if layout == "fused_transposed":
        return {prefix + attr: np.ascontiguousarray(full.transpose(0, 2, 1))}
    if attr == "down_proj":
        return {prefix + f"{e}." + _PER_EXPERT["down"]: full[e] for e in range(full.shape[0])}
    half = full.shape[1] // 2
    out = {}
    for e in range(full.shape[0]):
        out[prefix + f"{e}." + _PER_EXPERT["gate"]] = np.ascontiguousarray(full[e, :half])
        out[prefix + f"{e}." + _PER_EXPERT["up"]] = np.ascontiguousarray(full[e, half:])
    return out


_FUSED_KEY = re.compile(r"^(.*\.experts\.)(gate_up_proj|down_proj)$")
_EXPERT_KEY = re.compile(r"^(.*\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def convert_folder(source: str, out: str, layout: str, hidden_size: Optional[int] = None) -> Dict[str, str]:
    """Rewrite a Hugging Face folder's expert tensors in ``layout`` (every other tensor and file as
    it is). ``hidden_size`` tells the fused layouts apart (default: config.json's, or its text
    config's). Returns {experts prefix: the layout it was in}."""
    import shutil

    from mm_parallel.hf_checkpoint import SafetensorsFolder, write_weights

    if layout not in LAYOUTS:
        raise ValueError(f"expert layout {layout!r} is unknown; use one of {', '.join(LAYOUTS)}")
    hidden_size = hidden_size or _hidden_size(source)
    folder = SafetensorsFolder(source)
    state, found = {}, {}
    experts = {}
    for name in folder.names():
        fused, single = _FUSED_KEY.match(name), _EXPERT_KEY.match(name)
        if fused:
            experts.setdefault(fused.group(1), {})[fused.group(2)] = folder.read(name)
        elif single:
            experts.setdefault(single.group(1), {}).setdefault(int(single.group(2)), {})[single.group(3)] = \
                folder.read(name)
        else:
            state[name] = folder.read(name)
    for prefix, tensors in experts.items():
        memory, found[prefix] = _in_memory(prefix, tensors, hidden_size)
        for attr, full in memory.items():
            state.update(disk_tensors(prefix, attr, full, layout))
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(source):
        path = os.path.join(source, name)
        if os.path.isfile(path) and not name.startswith("model.safetensors") and not name.startswith("model-"):
            shutil.copy2(path, os.path.join(out, name))
    write_weights(state, out)
    return found


def _in_memory(prefix: str, tensors: dict, hidden: int):
    if "gate_up_proj" in tensors:
        gate_up, down = tensors["gate_up_proj"], tensors["down_proj"]
        if gate_up.shape[2] == hidden:
            return {"gate_up_proj": gate_up, "down_proj": down}, "fused"
        if gate_up.shape[1] != hidden:
            raise ValueError(f"{prefix}gate_up_proj {gate_up.shape} has no dim of hidden_size={hidden}")
        return {"gate_up_proj": gate_up.transpose(0, 2, 1), "down_proj": down.transpose(0, 2, 1)}, "fused_transposed"
    order = sorted(tensors)
    if order != list(range(len(order))):
        raise ValueError(f"{prefix}: experts {order} are not numbered 0..{len(order) - 1}")
    gate_up = np.stack([np.concatenate([tensors[e]["gate_proj"], tensors[e]["up_proj"]], 0) for e in order])
    return {"gate_up_proj": gate_up, "down_proj": np.stack([tensors[e]["down_proj"] for e in order])}, "per_expert"


def _hidden_size(source: str) -> int:
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    for part in (config, config.get("text_config") or {}, config.get("thinker_config", {}).get("text_config") or {}):
        if "hidden_size" in part:
            return int(part["hidden_size"])
    raise ValueError(f"{source}/config.json has no hidden_size; pass hidden_size")
