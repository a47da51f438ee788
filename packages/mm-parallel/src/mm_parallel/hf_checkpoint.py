"""Hugging Face safetensors folders: read this rank's shard of every tensor, write the full model back.

Reading parses the safetensors header (8-byte little-endian length, JSON of dtype / shape /
offsets) and memory-maps the data, so a tensor-parallel rank touches only the rows or columns it
keeps and bfloat16 checkpoints load without a framework (bf16 widens exactly to float32). A folder
holds ``model.safetensors`` or ``model.safetensors.index.json`` with its shards (transformers), or
``diffusion_pytorch_model.safetensors[.index.json]`` (diffusers).

Which slice a parameter takes comes from its sharding spec (mm_parallel.sharding: dims split over
tp / ep, fused parts); absent, it is replicated. For writing, `full_state` gathers split
parameters over their groups; `write_weights` / `write_index` write the files (the model's
save_pretrained decides which rank writes what: one file per pipeline stage, then the index).
"""

from __future__ import annotations

import json
import os
from typing import Callable, Dict, Optional, Tuple

import numpy as np
from mindspore import Tensor, nn

from mm_parallel import zero3
from mm_parallel.census import owned_parameters
from mm_parallel.precision import DTYPES
from mm_parallel.sharding import sharding_of
from mm_parallel.topology import get_topology

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
           "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
WEIGHT_NAMES = ("model.safetensors", "diffusion_pytorch_model.safetensors")


def _header(file: str) -> Tuple[dict, int]:
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if length <= 0 or length > 100 * 2 ** 20:
            raise ValueError(f"{file} is not a safetensors file (header length {length})")
        return json.loads(f.read(length)), 8 + length


class SafetensorsFolder:
    """Random access to the tensors of a checkpoint folder (one file or an index of shards)."""

    def __init__(self, path: str):
        self.path = str(path)
        self.files: Dict[str, str] = {}
        for base in WEIGHT_NAMES:
            index, single = os.path.join(self.path, base + ".index.json"), os.path.join(self.path, base)
            if os.path.exists(index):
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                self.files = {name: _inside(self.path, file, index) for name, file in weight_map.items()}
                break
            if os.path.exists(single):
                self.files = {name: single for name in safetensor_names(single)}
                break
        else:
            raise FileNotFoundError(f"no {' or '.join(WEIGHT_NAMES)} (or .index.json) in {self.path}")
        self._maps: Dict[str, Tuple[dict, np.memmap]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def names(self):
        return list(self.files)

    def _entry(self, name: str):
        file = self.files[name]
        if file not in self._maps:
            header, start = _header(file)
            self._maps[file] = (header, np.memmap(file, np.uint8, "r", offset=start))
        header, data = self._maps[file]
        return header[name], data

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(self._entry(name)[0]["shape"])

    def read(self, name: str, index=()) -> np.ndarray:
        """tensor[index] as float32 (or its integer dtype); only the indexed bytes are read."""
        if name not in self.files:
            raise KeyError(f"tensor {name!r} is not in the checkpoint at {self.path}")
        info, data = self._entry(name)
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{name}: dtype {info['dtype']} is not supported")
        begin, end = info["data_offsets"]
        array = data[begin:end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])[index]
        if info["dtype"] == "BF16":  # bfloat16 is the top half of a float32
            return (array.astype(np.uint32) << 16).view(np.float32)
        return np.array(array, dtype=np.float32 if array.dtype.kind == "f" else array.dtype)


def _inside(folder: str, file: str, index: str) -> str:
    """``folder/file`` for an index entry naming a file of the folder itself; anything else (an
    absolute path, ``..``, a sub-folder) is refused: an index must not make us read elsewhere."""
    if not isinstance(file, str) or os.path.basename(file) != file or file in ("", ".", ".."):
        raise ValueError(f"{index} names {file!r} as a weight file; an index may only name files in its own "
                         "folder (a bare file name such as model-00001-of-00002.safetensors)")
    return os.path.join(folder, file)


def safetensor_names(file: str):
    """The tensor names a safetensors file holds."""
    return [name for name in _header(file)[0] if name != "__metadata__"]


def load_weights(model: nn.Cell, path: str, name_map: Callable[[str], Optional[str]] = lambda n: n) -> int:
    """Set every parameter of ``model`` from the folder at ``path``, keeping this rank's shard.

    ``name_map`` turns a parameter's path into its checkpoint name, or a tuple of names to try in
    order (older checkpoint layouts), or None (not in checkpoints, e.g. LoRA adapters). A missing
    tensor or a shape mismatch is an error naming the tensor.
    Returns the number of tensors loaded.
    """
    folder = SafetensorsFolder(path)
    topology = get_topology(getattr(model, "topology", None))
    loaded = 0
    for name, param, cell, attr in owned_parameters(model):
        keys = name_map(name)
        if keys is None:
            continue
        keys = (keys,) if isinstance(keys, str) else tuple(keys)
        # a cell with its own ways on disk (MoE experts' layouts, an optional router bias); None: the usual read
        value = cell.read_hf_tensor(folder, keys, attr) if hasattr(cell, "read_hf_tensor") else None
        if value is not None:
            spec = sharding_of(param)
            _set(param, spec.flat_slice(value, topology) if spec.flat_over else value, keys[0], value.shape)
            loaded += 1
            continue
        key = next((k for k in keys if k in folder), None)
        if key is None:
            raise KeyError(f"{' / '.join(keys)} (parameter {name}) is missing from the checkpoint at {path}")
        full_shape = folder.shape(key)
        spec = sharding_of(param)
        try:
            index = spec.local_index(full_shape, topology)
        except ValueError as error:
            raise ValueError(f"{key}: {error}") from None
        value = folder.read(key, index)
        _set(param, spec.flat_slice(value, topology) if spec.flat_over else value, key, full_shape)
        loaded += 1
    return loaded


def _set(param, value: np.ndarray, key: str, full_shape) -> None:
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"{key}: checkpoint shape {tuple(full_shape)} gives {value.shape} on this rank, the model "
                         f"expects {tuple(param.shape)}; does config.json match the weights?")
    param.set_data(Tensor(np.ascontiguousarray(value.astype(np.float32)), param.dtype))


def full_state(model: nn.Cell, name_map: Callable[[str], Optional[str]] = lambda n: n,
               dtype=None, keep: bool = True) -> Dict[str, np.ndarray]:
    """Checkpoint name -> full numpy tensor, shards gathered (a collective: every rank of the split
    groups calls it); floating tensors in their parameter's dtype, or in ``dtype`` (a MindSpore
    float dtype) when given. ``keep=False``: take part in the gathers, keep nothing (a rank that
    writes no file holds one tensor at a time, not the whole state)."""
    topology = get_topology(getattr(model, "topology", None))
    state = {}
    for name, param, cell, attr in owned_parameters(model):
        key = name_map(name)
        if key is None:
            continue
        spec = sharding_of(param)
        value = spec.gather(param, topology) if spec.sharded else param
        if not keep:
            continue
        wanted = dtype if dtype is not None else zero3.value_dtype(param)  # a ZeRO-3 slice: its layer's dtype
        if value.dtype in DTYPES.values() and value.dtype != wanted:
            value = value.astype(wanted)
        value = value.asnumpy()  # float32, or bfloat16 / float16: safetensors writes BF16 / F16
        if hasattr(cell, "hf_tensors"):  # a cell that chooses its own tensors on disk (MoE experts)
            state.update(cell.hf_tensors(key, attr, value))
        else:
            state[key] = value
    return state


def write_weights(state: Dict[str, np.ndarray], path: str, file: str = "model.safetensors") -> None:
    """Write one safetensors file (transformers' metadata format "pt") atomically."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    tmp = os.path.join(path, f".{file}.tmp")
    save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(path, file))


def write_index(path: str, files: Dict[str, str], base: str = "model.safetensors",
                total_size: Optional[int] = None) -> None:
    """``<base>.index.json`` mapping every tensor name to its file; ``total_size`` (the tensors'
    bytes) is read from the files' headers unless given."""
    if total_size is None:
        total_size = 0
        for file in set(files.values()):
            header, _ = _header(os.path.join(path, file))
            total_size += sum(int(np.prod(v["shape"])) * np.dtype(_DTYPES[v["dtype"]]).itemsize
                              for k, v in header.items() if k != "__metadata__")
    with open(os.path.join(path, base + ".index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": dict(sorted(files.items()))}, f, indent=2)


def save_module(model: nn.Cell, path, config: dict, name_map: Callable[[str], Optional[str]] = lambda n: n,
                base: str = "model.safetensors") -> None:
    """Write a whole (unsplit) module as a Hugging Face folder: ``config`` as config.json and its
    parameters as ``base`` under ``name_map``'s names — the frozen encoders (VAE, text and image
    encoders), which every rank holds whole; one process writes."""
    path = str(path)
    write_weights(full_state(model, name_map), path, base)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def save_folder(models, path, name_map: Callable[[nn.Cell, str], Optional[str]], write_config: Callable[[str], None],
                base: str = "model.safetensors", dtype=None, folder_writer: Optional[bool] = None) -> None:
    """Write a Hugging Face folder from every rank's pipeline chunks; every rank calls it.

    ``models``: a model, or the list of chunks (virtual stages) a pipeline rank holds, each with
    ``topology`` and ``chunk``; ``name_map(model, path)`` gives a parameter's checkpoint name.
    Tensor-parallel shards are gathered; the first rank of each (dp, cp, tp) group writes its
    virtual stages, one file per virtual stage (``base`` without pipelining, else
    ``<stem>-0000k-of-0000n.safetensors``). The writers tell every rank which tensors each file
    holds (a gather, not a read of the others' files), and the ``folder_writer`` ranks (default
    global rank 0; on node-local disks the first rank of each node) write the config and the index.
    ``dtype``: the floating tensors' dtype on disk (default: each parameter's own).
    """
    from mm_parallel import comm
    from mm_parallel.topology import get_topology

    models = list(models) if isinstance(models, (list, tuple)) else [models]
    topo = get_topology(models[0].topology)
    path, stem = str(path), base[: -len(".safetensors")]
    total = topo.pp.size * topo.config.vpp
    writer = topo.tp.rank == 0 and topo.cp.rank == 0 and topo.dp.rank == 0
    written = {}  # file -> (tensor names, bytes)
    for model in models:
        state = full_state(model, lambda name, m=model: name_map(m, name), dtype, keep=writer)
        virtual = model.chunk * topo.pp.size + topo.pp.rank
        file = base if total == 1 else f"{stem}-{virtual + 1:05d}-of-{total:05d}.safetensors"
        if writer:
            write_weights(state, path, file)
            written[file] = (sorted(state), sum(int(v.nbytes) for v in state.values()))
    if topo.world_size > 1:  # every stage's file is complete (and named) before the index names it
        parts = comm.all_gather_bytes(json.dumps(written).encode(), topo.world)
        written = {file: entry for part in parts for file, entry in json.loads(part).items()}
    if topo.rank == 0 if folder_writer is None else folder_writer:
        os.makedirs(path, exist_ok=True)
        write_config(path)
        if total > 1:
            write_index(path, {name: file for file, (names, _) in written.items() for name in names}, base,
                        total_size=sum(size for _, size in written.values()))
    if topo.world_size > 1:
        comm.barrier(topo.world)  # nobody reads the folder before it is complete
