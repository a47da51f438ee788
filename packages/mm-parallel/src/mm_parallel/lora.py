"""LoRA on plain and tensor-parallel linears, saved and loaded in PEFT's format.

    y = base(x) + dropout(x) A^T B^T * alpha / r        A: (r, in), B: (out, r), B starts at zero

Sharding follows the base weight so no extra layout appears:
  column-parallel base (out split): A whole on every rank, B split on out. Each rank's gradient of
      A only sees its B rows, so A is marked to have its gradient summed over tp
      (`sync_sequence_parallel_grads` does it: the same rule as a sequence-parallel norm).
  row-parallel base (in split): A split on in, h = sum over tp of x_r A_r^T (a reduce, or a
      reduce-scatter under sequence parallel), B whole; under SP, B sees a sequence shard: marked.
The LoRA branch passes its input through the same region as the base layer (copy / gather-sequence
/ scatter), each branch with its own backward, which sums correctly.

Files: ``adapter_config.json`` (peft_type LORA, r, lora_alpha, lora_dropout, target_modules) and
``adapter_model.safetensors`` with PEFT's keys ``base_model.model.<module>.lora_A.weight`` /
``lora_B.weight``, full (gathered) tensors, written by global rank 0.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import zlib
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mm_parallel import census, comm, mappings
from mm_parallel.precision import keep_in_fp32
from mm_parallel.sequence_parallel import mark_sequence_parallel
from mm_parallel.sharding import sharding_of, split
from mm_parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, init_rng, linear, shard, unshard
from mm_parallel.topology import get_topology


@dataclass
class LoraConfig:
    """What a recipe asks for: rank, alpha, dropout and the module-path suffixes to adapt (PEFT's
    target_modules). Model plans subclass it with their default targets."""
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: List[str] = field(default_factory=list)


def _mm(x, w):
    """x w^T over the last dim: the projection the parallel linears use, without bias."""
    return linear(x, w, None)


class LoraLinear(nn.Cell):
    """A frozen base linear (``base_layer``, as PEFT names it) plus the low-rank update."""

    def __init__(self, base: nn.Cell, r: int, alpha: float, dropout: float = 0.0, key: Optional[str] = None):
        super().__init__()
        if r < 1:
            raise ValueError(f"LoRA rank r must be >= 1, got {r}")
        self.base_layer = base
        self.kind = ("column" if isinstance(base, ColumnParallelLinear) else
                     "row" if isinstance(base, RowParallelLinear) else "plain")
        self.scaling = alpha / r
        self.dropout = dropout
        self.merged = False
        self.disabled = False  # `adapters_disabled`: the base layer alone
        out_local, in_local = base.weight.shape
        group = getattr(base, "group", None)
        in_full = in_local * (group.size if self.kind == "row" else 1)
        bound = 1.0 / math.sqrt(in_full)  # PEFT's default: kaiming-uniform(a=sqrt 5) on A, zeros on B

        def a_local():
            # ``key`` (the module's path in the whole model): A drawn from it, so that a pipeline stage,
            # which builds only its own layers, draws what one process draws for the same layer
            rng = init_rng() if key is None else np.random.default_rng([ms.get_seed() or 0, zlib.crc32(key.encode())])
            a_full = rng.uniform(-bound, bound, (r, in_full)).astype(np.float32)
            return shard(a_full, group, 1) if self.kind == "row" else a_full

        self.lora_A = census.parameter((r, in_local), "lora_A", a_local)
        self.lora_B = census.filled((out_local, r), "lora_B", 0.0)
        keep_in_fp32(self.lora_A, self.lora_B)  # adapters train in fp32 under a bf16 base (as PEFT does)
        # the adapters are split like their base weight: B's rows of a column layer, A's columns of a row layer
        if self.kind == "column":
            split(self.lora_B, (0, "tp"))
        elif self.kind == "row":
            split(self.lora_A, (1, "tp"))
        if self.kind == "column" and group.size > 1:
            mark_sequence_parallel(self.lora_A)
        if self.kind == "row" and base.sequence_parallel:
            mark_sequence_parallel(self.lora_B)

    def _drop(self, x):
        return ops.dropout(x, p=self.dropout, training=self.training) if self.dropout and self.training else x

    def construct(self, x):
        y = self.base_layer(x)
        if self.merged or self.disabled:
            return y
        base = self.base_layer
        if self.kind == "column":
            h = mappings.gather_from_sequence(x, base.group, base.seq_dim) if base.sequence_parallel else \
                mappings.copy_to_region(x, base.group)
            u = _mm(_mm(self._drop(h), self.lora_A), self.lora_B) * self.scaling
            return y + (mappings.gather_from_region(u, base.group, -1) if base.gather_output else u)
        if self.kind == "row":
            h = x if base.input_is_parallel else mappings.scatter_to_region(x, base.group, -1)
            h = _mm(self._drop(h), self.lora_A)
            h = mappings.reduce_scatter_to_sequence(h, base.group, base.seq_dim) if base.sequence_parallel else \
                mappings.reduce_from_region(h, base.group)
            return y + _mm(h, self.lora_B) * self.scaling
        return y + _mm(_mm(self._drop(x), self.lora_A), self.lora_B) * self.scaling

    def delta(self):
        """This rank's shard of scaling * B A, the update merged into the base weight."""
        return ops.matmul(self.lora_B, self.lora_A) * self.scaling

    def merge(self):
        if not self.merged:
            self.base_layer.weight.set_data(self.base_layer.weight + self.delta())
            self.merged = True

    def unmerge(self):
        if self.merged:
            self.base_layer.weight.set_data(self.base_layer.weight - self.delta())
            self.merged = False


def _matches(name: str, targets: Iterable[str]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def lora_layers(model: nn.Cell) -> Dict[str, LoraLinear]:
    return {name: cell for name, cell in model.cells_and_names() if isinstance(cell, LoraLinear)}


def apply_lora(model: nn.Cell, target_modules: List[str], r: int = 8, alpha: float = 16.0, dropout: float = 0.0):
    """Wrap every linear whose module path ends with one of ``target_modules`` (PEFT's rule) and
    freeze everything else; returns {module path: LoraLinear}."""
    for param in model.get_parameters():
        param.requires_grad = False
    found = [(name, cell) for name, cell in model.cells_and_names() if name and _matches(name, target_modules)]
    if not found:
        raise ValueError(f"no module matches target_modules={target_modules}; module paths end with e.g. "
                         f"{sorted({n.split('.')[-1] for n, _ in model.cells_and_names() if n})[:10]}")
    cells = dict(model.cells_and_names())
    for name, cell in found:
        if not hasattr(cell, "weight") or len(cell.weight.shape) != 2:
            raise ValueError(f"LoRA target {name} is not a linear layer (no 2-D weight)")
        parent_name, _, child = name.rpartition(".")
        parent = cells[parent_name] if parent_name else model
        key = model.global_name(name) if hasattr(model, "global_name") else name  # the same under any pp
        wrapped = LoraLinear(cell, r, alpha, dropout, key)
        if isinstance(parent, (nn.CellList, nn.SequentialCell)):
            parent[int(child)] = wrapped
        else:
            setattr(parent, child, wrapped)
        # full paths, PEFT-like: "0.q.lora_A", "0.q.base_layer.weight"
        for relative, param in wrapped.parameters_and_names():
            param.name = f"{name}.{relative}"
    return lora_layers(model)


@contextlib.contextmanager
def adapters_disabled(models: Iterable[nn.Cell]):
    """The models' LoRA layers compute their base layers alone while the context is open (PEFT's
    ``disable_adapter``): the model before fine-tuning, with no second copy of it (DPO's
    reference). Merged adapters are refused: their update is inside the base weight."""
    layers = [layer for model in models for layer in lora_layers(model).values()]
    if any(layer.merged for layer in layers):
        raise ValueError("the adapters are merged into the base weights; unmerge them before switching them off")
    for layer in layers:
        layer.disabled = True
    try:
        yield
    finally:
        for layer in layers:
            layer.disabled = False


def merge_lora(model: nn.Cell):
    for layer in lora_layers(model).values():
        layer.merge()


def unmerge_lora(model: nn.Cell):
    for layer in lora_layers(model).values():
        layer.unmerge()


def save_lora(model, path: str, target_modules: List[str], r: int, alpha: float, dropout: float = 0.0,
              name_map: Callable[[nn.Cell, str], str] = lambda model, name: name,
              folder_writer: Optional[bool] = None):
    """Write the adapters in PEFT's format; every rank calls it.

    ``model``: a Cell, or the list of chunks a pipeline rank holds. ``name_map(model, path)`` gives
    the module name the file uses (e.g. a pipeline stage's local layer number made the model's).
    Tensors are gathered over tp; with pipeline stages each stage's first rank sends its part (a
    safetensors blob: adapters are small) to every rank, and the ``folder_writer`` ranks (default
    global rank 0; on node-local disks the first rank of each node) write the merged
    adapter_model.safetensors and adapter_config.json.
    """
    from safetensors.numpy import load, save, save_file

    topo = get_topology()
    tensors = {}
    for chunk in (model if isinstance(model, (list, tuple)) else [model]):
        for name, layer in lora_layers(chunk).items():
            for which in ("lora_A", "lora_B"):
                value = getattr(layer, which)
                dim = sharding_of(value).dim("tp")
                full = value if dim is None else unshard(value, layer.base_layer.group, dim)
                key = f"base_model.model.{name_map(chunk, name)}.{which}.weight"
                tensors[key] = np.ascontiguousarray(full.asnumpy())
    stage_writer = topo.tp.rank == 0 and topo.cp.rank == 0 and topo.dp.rank == 0
    parts = comm.all_gather_bytes(save(tensors) if stage_writer and tensors else b"", topo.world)
    if topo.rank == 0 if folder_writer is None else folder_writer:
        merged = {}
        for blob in parts:
            if blob:
                merged.update(load(blob))
        os.makedirs(path, exist_ok=True)
        config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "lora_dropout": dropout,
                  "target_modules": list(target_modules), "bias": "none", "fan_in_fan_out": False,
                  "use_rslora": False, "init_lora_weights": True, "modules_to_save": None, "task_type": None,
                  "base_model_name_or_path": None, "inference_mode": True}
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(config, f, indent=2)
        save_file(dict(sorted(merged.items())), os.path.join(path, "adapter_model.safetensors"))
    comm.barrier()


def load_lora(model: nn.Cell, path: str, name_map: Callable[[nn.Cell, str], str] = lambda model, name: name):
    """Read PEFT adapters into a model that `apply_lora` already wrapped; each rank keeps its shard.
    ``name_map`` as in `save_lora`."""
    from safetensors.numpy import load_file

    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    layers = {name_map(model, name): layer for name, layer in lora_layers(model).items()}
    missing = [n for n in layers if f"base_model.model.{n}.lora_A.weight" not in tensors]
    if missing:
        raise ValueError(f"{path} has no adapter for {missing}; it was saved for other target_modules")
    for name, layer in layers.items():
        for which in ("lora_A", "lora_B"):
            full = tensors[f"base_model.model.{name}.{which}.weight"]
            param = getattr(layer, which)
            dim = sharding_of(param).dim("tp")
            local = full if dim is None else shard(full, layer.base_layer.group, dim)
            if tuple(local.shape) != tuple(param.shape):
                raise ValueError(f"{name}.{which}: file shape {full.shape} does not fit {tuple(param.shape)} "
                                 "(rank r differs?)")
            param.set_data(Tensor(np.ascontiguousarray(local)))


class PeftAdapters:
    """``load_adapter`` / ``save_adapter`` in PEFT's format for a model class (mixed into it).
    The class names its modules in the whole model through ``adapter_name(model, path)`` (a
    pipeline stage's local layer numbers made the model's); the default keeps the path."""

    def adapter_name(self, model, name: str) -> str:
        return name

    def load_adapter(self, path):
        """Read PEFT LoRA adapters into a model `apply_lora` wrapped, this rank's shard."""
        load_lora(self, str(path), self.adapter_name)

    def save_adapter(self, path, lora: LoraConfig, chunks=None, folder_writer: Optional[bool] = None):
        """Write the LoRA adapters (``lora``: the plan's LoraConfig); all ranks call. With virtual
        pipeline stages pass every chunk this rank holds as ``chunks``; ``folder_writer`` as in
        `save_lora`."""
        save_lora(chunks or self, str(path), lora.target_modules, lora.r, lora.alpha, lora.dropout, self.adapter_name,
                  folder_writer)
