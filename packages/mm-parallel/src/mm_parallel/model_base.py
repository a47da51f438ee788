"""What every parallel model class shares: its pipeline stage, its Hugging Face folder, its loss
over context-parallel ranks and its way into the sequence-split layers.

A model class derives from `ParallelModel` and supplies only what is its own:

    layer_prefix         module path of its numbered layers ("blocks.", "model.language_model.layers.")
    weights_name         the folder's weight file ("model.safetensors", "diffusion_pytorch_model.safetensors")
    load_config(path)    its config from a folder (or a config object / mapping), as a classmethod
    write_config(path)   config.json into a folder
    disk_names(name)     (optional) the on-disk names of a checkpoint name, preferred first

Pipeline stage (Megatron's interleaving): the object holds one virtual stage, chunk c of pipeline
rank s being virtual stage v = c * pp + s of pp * vpp; `build_stage` cuts the layers
(`pipeline.stage_layer_ranges`) and sets ``chunk``, ``layer_offset`` (the first layer's number in
the whole model), ``is_first`` (v = 0: holds the embeddings) and ``is_last`` (v = pp vpp - 1: holds
the head). Checkpoint and PEFT names number layers as the whole model does.

Context parallelism: each cp rank holds a part of a sample's tokens, so a loss that is a sum over
tokens divided by the whole sample's count is the sum over cp of the ranks' parts,

    L = sum_r L_r        (forward: all-reduce over cp; backward: identity, dL/dL_r = 1)

and each rank differentiates its own part; the optimizer sums the gradients over cp.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence, Tuple

import numpy as np
from mindspore import Tensor, nn

from mm_parallel import mappings
from mm_parallel.context_parallel import split_sequence
from mm_parallel.lora import PeftAdapters
from mm_parallel.pipeline import stage_layer_ranges
from mm_parallel.topology import Topology, get_topology


class ParallelModel(PeftAdapters, nn.Cell):
    """Base of the parallel model classes; see the module docstring."""

    layer_prefix = ""
    weights_name = "model.safetensors"

    # -- pipeline stage ------------------------------------------------------------------------

    def build_stage(self, topology: Optional[Topology], chunk: int, num_layers: int,
                    pipeline_num_layers=None) -> range:
        """Set the topology and this object's virtual stage; returns the layer numbers it holds
        (``pipeline_num_layers``, else the topology's parallel.pp_layers, else an even split)."""
        self.topology = topology = get_topology(topology)
        pp, vpp = topology.pp.size, topology.config.vpp
        if pipeline_num_layers is None:
            pipeline_num_layers = topology.config.pp_layers
        if not 0 <= chunk < vpp:
            raise ValueError(f"chunk {chunk} does not exist: vpp={vpp} chunks per pipeline rank")
        layers = stage_layer_ranges(num_layers, pp, vpp, pipeline_num_layers)[chunk][topology.pp.rank]
        virtual = chunk * pp + topology.pp.rank
        self.chunk, self.layer_offset = chunk, layers.start
        self._local_positions = {}  # (length, sequence_parallel) -> local_positions
        self.is_first, self.is_last = virtual == 0, virtual == pp * vpp - 1
        return layers

    def require_whole_model(self) -> None:
        """The one-stage guard: a plain forward needs every layer in this object."""
        if not (self.is_first and self.is_last):
            raise ValueError("this model holds one pipeline stage: train it with pipeline_stage / pipeline_loss "
                             "under mm_parallel.pipeline's schedules")

    # -- names ---------------------------------------------------------------------------------

    def global_name(self, name: str) -> str:
        """A module or parameter path with this stage's layer numbers made the whole model's."""
        if not self.layer_offset or not self.layer_prefix:
            return name
        pattern = "^" + re.escape(self.layer_prefix) + r"(\d+)\."
        return re.sub(pattern, lambda m: f"{self.layer_prefix}{int(m.group(1)) + self.layer_offset}.", name + ".")[:-1]

    def adapter_name(self, model, name: str) -> str:
        """PEFT's module name (see PeftAdapters): the whole model's layer numbers."""
        return model.global_name(name)

    def checkpoint_name(self, name: str) -> Optional[str]:
        """The checkpoint name of a parameter path: LoRA's wrapped base weight under its own name,
        layers numbered as in the whole model; None for the adapters (not in model checkpoints)."""
        if ".lora_A" in name or ".lora_B" in name:
            return None
        return self.global_name(name.replace(".base_layer.", "."))

    def disk_names(self, name: str) -> Tuple[str, ...]:
        """The names a checkpoint tensor may have on disk, the one to write first."""
        return (name,)

    def _names_to_read(self, path: str):
        name = self.checkpoint_name(path)
        return None if name is None else self.disk_names(name)

    def _name_to_write(self, path: str) -> Optional[str]:
        name = self.checkpoint_name(path)
        return None if name is None else self.disk_names(name)[0]

    # -- Hugging Face folders --------------------------------------------------------------------

    @classmethod
    def load_config(cls, config, overrides: Optional[dict] = None):
        raise NotImplementedError(f"{cls.__name__} must define load_config")

    def write_config(self, path: str, dtype: str = "float32") -> None:
        """Write config.json; ``dtype``: the weights' dtype as torch names it (transformers
        records it as ``dtype``; diffusers records none)."""
        raise NotImplementedError(f"{type(self).__name__} must define write_config")

    @classmethod
    def from_config(cls, config, topology: Optional[Topology] = None, **stage):
        """A randomly initialised model (``chunk`` / ``pipeline_num_layers`` choose the stage)."""
        return cls(cls.load_config(config), topology, **stage)

    @classmethod
    def from_pretrained(cls, path, topology: Optional[Topology] = None, chunk: int = 0, pipeline_num_layers=None,
                        **overrides):
        """Load a Hugging Face folder, each rank reading only its shard; ``chunk`` /
        ``pipeline_num_layers`` choose the pipeline stage, other keywords override config values."""
        from mm_parallel.hf_checkpoint import load_weights

        config = cls.load_config(path, overrides)
        model = cls(config, topology, chunk=chunk, pipeline_num_layers=pipeline_num_layers)
        load_weights(model, str(path), model._names_to_read)
        return model

    def save_pretrained(self, path, chunks: Optional[Sequence] = None, dtype: Optional[str] = None,
                        folder_writer: Optional[bool] = None) -> None:
        """Write the Hugging Face folder its original library loads; every rank calls it. With
        virtual pipeline stages pass every chunk this rank holds as ``chunks``. ``dtype`` (fp32 /
        bf16 / fp16 or the torch names): the weights' dtype on disk; default each parameter's own
        (a bf16 run writes bf16, its modules kept in fp32 stay fp32, as transformers saves).
        ``folder_writer``: whether this rank writes the config and index (`save_folder`)."""
        from mm_parallel import precision
        from mm_parallel.hf_checkpoint import save_folder

        models = list(chunks) if chunks else [self]
        target = None if dtype is None else precision.dtype_named(dtype)
        name = precision.torch_name(target) if target is not None else \
            precision.dominant_dtype_name([p for m in models for p in m.get_parameters()])
        save_folder(models, path, lambda model, name: model._name_to_write(name),
                    lambda folder: self.write_config(folder, name), base=self.weights_name, dtype=target,
                    folder_writer=folder_writer)

    # -- sequence layout -------------------------------------------------------------------------

    def enter_sequence(self, x, seq_dim: int = 1):
        """The embeddings cut to this rank's tokens: its context-parallel part (split_sequence),
        then under sequence parallelism its chunk over tp (backward: all-gather)."""
        topo = self.topology
        if topo.cp.size > 1:
            x = split_sequence(x, seq_dim, topo)
        if topo.config.sequence_parallel and topo.tp.size > 1:
            x = mappings.scatter_to_sequence(x, topo.tp, seq_dim)
        return x

    def local_positions(self, length: int, sequence_parallel: bool = True) -> np.ndarray:
        """The positions of a full sequence of ``length`` this rank holds after `enter_sequence`:
        its context-parallel part and, with ``sequence_parallel`` (where the layout uses it), its
        chunk over tp; host integers, for tables and masks that follow the tokens (kept per
        length: a forward asks for them several times)."""
        key = (length, sequence_parallel)
        if key not in self._local_positions:
            positions = self._split_positions(length, sequence_parallel)
            positions.setflags(write=False)  # shared by the callers
            self._local_positions[key] = positions
        return self._local_positions[key]

    def _split_positions(self, length: int, sequence_parallel: bool) -> np.ndarray:
        topo, positions = self.topology, np.arange(length, dtype=np.int64)
        if topo.cp.size > 1:
            positions = split_sequence(Tensor(positions[None]), 1, topo).asnumpy()[0]
        if sequence_parallel and topo.config.sequence_parallel and topo.tp.size > 1:
            if positions.shape[0] % topo.tp.size:
                raise ValueError(f"{positions.shape[0]} tokens per context-parallel rank cannot be split over "
                                 f"tp={topo.tp.size} for sequence parallelism: pad the sequence")
            per = positions.shape[0] // topo.tp.size
            positions = positions[topo.tp.rank * per:(topo.tp.rank + 1) * per]
        return positions

    def reduce_loss_over_cp(self, loss):
        """This rank's part of a token-summed loss made the whole sample's (module docstring)."""
        topo = self.topology
        return mappings.reduce_from_region(loss, topo.cp) if topo.cp.size > 1 else loss
