"""Expert weights on disk: the three layouts users have, recognised by key names and shapes.

    fused              transformers' in-memory layout   experts.gate_up_proj (E, 2I, H), experts.down_proj (E, H, I)
    fused_transposed   the hub's Qwen3-VL-MoE files      experts.gate_up_proj (E, H, 2I), experts.down_proj (E, I, H)
    per_expert         Qwen2/3-MoE files, Megatron       experts.{e}.gate_proj.weight (I, H), .up_proj (I, H),
                                                         .down_proj (H, I)

A rank reads only its experts (and under expert tensor parallelism only its rows of I) from any
of them. The two fused layouts are told apart by the pair of shapes: gate_up (E, a, b) with down
(E, b, a / 2) is fused, with down (E, b / 2, a) transposed; one tensor alone can be ambiguous
(gate_up when 2I = H, down when I = H — transformers' loader, which checks gate_up alone,
reads a transposed file with 2I = H as fused), the pair never is. Saving writes the layout the
weights were read in, or the one set in ``GroupedExperts.save_layout``; `convert_folder`
rewrites a folder from one layout to another without building a model.
"""

from __future__ import annotations

import os
import re
from typing import Dict, Tuple

import numpy as np

LAYOUTS = ("fused", "fused_transposed", "per_expert")
_PER_EXPERT = {"gate": "gate_proj.weight", "up": "up_proj.weight", "down": "down_proj.weight"}


def memory_shapes(num_experts: int, hidden: int, intermediate: int) -> Dict[str, Tuple[int, ...]]:
    return {"gate_up_proj": (num_experts, 2 * intermediate, hidden), "down_proj": (num_experts, hidden, intermediate)}


def fused_layout(gate_up_shape, down_shape) -> str:
    """"fused" or "fused_transposed" from the shapes of a stack's two fused tensors (module docstring)."""
    g, d = tuple(gate_up_shape), tuple(down_shape)
    if len(g) == len(d) == 3 and g[0] == d[0]:
        if g[1] == 2 * d[2] and g[2] == d[1]:
            return "fused"
        if g[2] == 2 * d[1] and g[1] == d[2]:
            return "fused_transposed"
    raise ValueError(f"expert tensors gate_up_proj {g} and down_proj {d} are neither (E, 2I, H) and (E, H, I) "
                     "(fused) nor (E, H, 2I) and (E, I, H) (transposed)")


def detect_layout(folder, prefix: str) -> str:
    """Which layout ``folder`` (a SafetensorsFolder) stores the ``prefix`` experts in."""
    gate_up, down = prefix + "gate_up_proj", prefix + "down_proj"
    if gate_up in folder and down in folder:
        return fused_layout(folder.shape(gate_up), folder.shape(down))
    if prefix + "0." + _PER_EXPERT["down"] in folder:
        return "per_expert"
    raise KeyError(f"{gate_up} / {down} are missing from the checkpoint at {folder.path}, and so are per-expert "
                   f"keys ({prefix}0.gate_proj.weight ...)")


def read_local(folder, prefix: str, attr: str, experts) -> Tuple[np.ndarray, str]:
    """This rank's slice of ``experts.<attr>`` in the in-memory layout, and the layout on disk."""
    from mm_parallel.sharding import sharding_of

    param = getattr(experts, attr)
    full = memory_shapes(experts.num_experts, experts.hidden, experts.intermediate)[attr]
    layout = detect_layout(folder, prefix)
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


_SHARD_BYTES = 2 << 30  # output files of at most ~2 GB, as transformers' save_pretrained shards


def convert_folder(source: str, out: str, layout: str) -> Dict[str, str]:
    """Rewrite a Hugging Face folder's expert tensors in ``layout``, every other tensor and file as
    it is. One expert stack (or one other tensor) is in memory at a time; the output is
    ``model.safetensors``, or shards of ~2 GB with their index. Returns {experts prefix: the
    layout it was in}."""
    import shutil

    from mm_parallel.hf_checkpoint import SafetensorsFolder

    if layout not in LAYOUTS:
        raise ValueError(f"expert layout {layout!r} is unknown; use one of {', '.join(LAYOUTS)}")
    folder, units = SafetensorsFolder(source), {}
    for name in folder.names():  # a unit: one expert stack's tensors, or one other tensor
        match = _FUSED_KEY.match(name) or _EXPERT_KEY.match(name)
        units.setdefault(match.group(1) if match else name, []).append(name)
    os.makedirs(out, exist_ok=True)
    writer, found = _ShardWriter(out), {}
    for unit, names in units.items():
        if not (_FUSED_KEY.match(names[0]) or _EXPERT_KEY.match(names[0])):
            writer.add({unit: folder.read(unit)})
            continue
        tensors = {}
        for name in names:
            fused, single = _FUSED_KEY.match(name), _EXPERT_KEY.match(name)
            if fused:
                tensors[fused.group(2)] = folder.read(name)
            else:
                tensors.setdefault(int(single.group(2)), {})[single.group(3)] = folder.read(name)
        memory, found[unit] = _in_memory(unit, tensors)
        for attr, full in memory.items():
            writer.add(disk_tensors(unit, attr, full, layout))
    writer.close()
    for name in os.listdir(source):
        path = os.path.join(source, name)
        if os.path.isfile(path) and not name.startswith("model.safetensors") and not name.startswith("model-"):
            shutil.copy2(path, os.path.join(out, name))
    return found


class _ShardWriter:
    """Tensors written in order into files of at most _SHARD_BYTES (one file: model.safetensors)."""

    def __init__(self, out: str):
        self.out, self.files, self.pending, self.size = out, [], {}, 0

    def add(self, tensors: Dict[str, np.ndarray]) -> None:
        nbytes = sum(t.nbytes for t in tensors.values())
        if self.pending and self.size + nbytes > _SHARD_BYTES:
            self._flush()
        self.pending.update(tensors)
        self.size += nbytes

    def _flush(self) -> None:
        from mm_parallel.hf_checkpoint import write_weights

        file = f"part-{len(self.files):05d}.safetensors"
        write_weights(self.pending, self.out, file)
        self.files.append((file, list(self.pending)))
        self.pending, self.size = {}, 0

    def close(self) -> None:
        from mm_parallel.hf_checkpoint import write_index

        if self.pending or not self.files:
            self._flush()
        if len(self.files) == 1:
            os.replace(os.path.join(self.out, self.files[0][0]), os.path.join(self.out, "model.safetensors"))
            return
        weight_map, total = {}, len(self.files)
        for index, (file, names) in enumerate(self.files):
            final = f"model-{index + 1:05d}-of-{total:05d}.safetensors"
            os.replace(os.path.join(self.out, file), os.path.join(self.out, final))
            weight_map.update({name: final for name in names})
        write_index(self.out, weight_map)


def _in_memory(prefix: str, tensors: dict):
    """({gate_up_proj, down_proj} in the in-memory layout, the layout they were in)."""
    if "gate_up_proj" in tensors or "down_proj" in tensors:
        if set(tensors) != {"gate_up_proj", "down_proj"}:
            raise ValueError(f"{prefix}: found {sorted(tensors)}, need both gate_up_proj and down_proj")
        gate_up, down = tensors["gate_up_proj"], tensors["down_proj"]
        layout = fused_layout(gate_up.shape, down.shape)
        if layout == "fused_transposed":
            gate_up, down = gate_up.transpose(0, 2, 1), down.transpose(0, 2, 1)
        return {"gate_up_proj": gate_up, "down_proj": down}, layout
    order = sorted(tensors)
    if order != list(range(len(order))):
        raise ValueError(f"{prefix}: experts {order} are not numbered 0..{len(order) - 1}")
    gate_up = np.stack([np.concatenate([tensors[e]["gate_proj"], tensors[e]["up_proj"]], 0) for e in order])
    return {"gate_up_proj": gate_up, "down_proj": np.stack([tensors[e]["down_proj"] for e in order])}, "per_expert"
