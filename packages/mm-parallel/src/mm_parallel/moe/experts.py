"""`GroupedExperts`: this rank's experts as two fused tensors, computed as one batched matmul.

Weights in transformers' in-memory layout (Qwen3-MoE / Qwen3-VL-MoE ``mlp.experts``):

    gate_up_proj (E_local, 2 I, H)     rows [0, I) the gate, [I, 2 I) the up projection
    down_proj    (E_local, H, I)
    expert e:    y = down_e (act(gate_e x) * up_e x)

Expert parallelism cuts dim 0 over ep (rank p holds experts [p E/P, (p+1) E/P)); expert tensor
parallelism (``expert_tp`` = tp) cuts I over tp as a tensor-parallel MLP does (gate and up by
rows, each part alone; down by columns), the output a partial sum that one all-reduce over tp
completes. Gradients are averaged over expert-dp (mm_parallel.sharding ``grad_sync="edp"``).

Grouped matmul: on CPU the rows of each local expert are gathered into a (E_local, M, H) block
padded to the largest group M (mm_parallel.moe.token_layout), then two BatchMatMuls compute every
expert at once; no Python loop over experts (benchmarks/moe.py measures both). On Ascend the rows
are gathered expert after expert without padding and Ascend's grouped_matmul kernel computes
them (mm_parallel.ops.grouped_matmul); the outputs are laid out as the padded block's, so both
paths return the same thing.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from mindspore import Tensor, nn, ops

from mm_parallel import census, mappings, zero3
from mm_parallel.blocks import activation
from mm_parallel.ops.activations import silu, swiglu
from mm_parallel.ops.device import use_fused, with_zero_row
from mm_parallel.ops.grouped_matmul import grouped_matmul, padded_slots
from mm_parallel.ops.low_precision import LOW, matmul_operands, to_compute
from mm_parallel.sharding import ParamSharding, set_sharding
from mm_parallel.tensor_parallel import init_rng, sharded_shape
from mm_parallel.topology import Topology, get_topology

_bmm_transposed = ops.BatchMatMul(transpose_b=True)


def _expert_matmul(x, weight, counts=None):
    """x @ weight^T per expert, in the weight's dtype (mm_parallel.ops.low_precision): ``x`` the
    (E, M, K) padded block, or with ``counts`` the rows grouped by expert (Ascend's grouped
    matmul); a ZeRO-3 weight gathered for the matmul alone (mm_parallel.zero3)."""
    if zero3.is_sharded(weight):
        dtype = zero3.compute_dtype(weight)
        y = zero3.gathered_experts(to_compute(x, dtype), weight, counts if counts is not None else np.zeros(0))
    elif counts is not None:
        return grouped_matmul(x, weight.astype(x.dtype), counts)
    else:
        dtype = weight.dtype
        x, w = matmul_operands(x, weight)
        y = _bmm_transposed(x, w)
    return to_compute(y, dtype) if dtype in LOW else y


class GroupedExperts(nn.Cell):
    """See the module docstring. ``construct(tokens, groups)``: ``tokens`` (N + 1, H), a buffer
    whose last row is zeros; ``groups`` an `ExpertGroups` over it. Returns (E_local M + 1, H):
    every padded slot's output, then a zero row."""

    ZERO3_WEIGHTS, ZERO3_REGION = ("gate_up_proj", "down_proj"), "experts"  # through `_expert_matmul`

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str = "silu", *,
                 topology: Optional[Topology] = None, init_std: Optional[float] = None):
        super().__init__()
        topo = self.topology = get_topology(topology)
        if num_experts % topo.ep.size:
            raise ValueError(f"{num_experts} experts cannot be split over ep={topo.ep.size}; choose an ep that "
                             "divides the number of experts")
        self.num_experts, self.local = num_experts, num_experts // topo.ep.size
        self.first = topo.ep.rank * self.local
        self.tp_group = topo.tp if topo.config.expert_tp_size > 1 else None
        if self.tp_group is not None and intermediate_size % self.tp_group.size:
            raise ValueError(f"moe_intermediate_size={intermediate_size} cannot be split over expert_tp="
                             f"{self.tp_group.size}; use expert_tp=1 or a tp that divides it")
        self.hidden, self.intermediate = hidden_size, intermediate_size
        tp = self.tp_group is not None
        gate_up = ParamSharding(((0, "ep"), (1, "tp")) if tp else ((0, "ep"),), "edp",
                                fused=(intermediate_size, intermediate_size) if tp else ())
        down = ParamSharding(((0, "ep"), (2, "tp")) if tp else ((0, "ep"),), "edp")
        self.gate_up_proj = self._drawn((num_experts, 2 * intermediate_size, hidden_size), "gate_up_proj", gate_up,
                                        init_std)
        self.down_proj = self._drawn((num_experts, hidden_size, intermediate_size), "down_proj", down, init_std)
        self.act = activation(act)
        self.checkpoint_layout = None  # the layout the weights were read in (mm_parallel.moe.checkpoint)
        self.save_layout = None  # the layout to write; None: the one read, else "fused"

    def _drawn(self, full_shape, name, spec, init_std):
        """Each expert drawn from its own seed (the same numbers on every rank and layout), only
        this rank's experts drawn, then cut to its tp shard."""
        local_shape = (self.local,) + tuple(full_shape[1:])
        for dim, group in spec.splits:
            if group == "tp":
                local_shape = sharded_shape(local_shape, self.tp_group, dim)

        def value():
            seeds = init_rng().integers(0, 2 ** 63, full_shape[0])
            experts = [np.random.default_rng(int(seeds[e])).normal(0.0, init_std or 0.02, full_shape[1:])
                       for e in range(self.first, self.first + self.local)]
            tp_part = ParamSharding(tuple((d - 1, g) for d, g in spec.splits if g == "tp"), fused=spec.fused)
            return np.stack([tp_part.local(e, self.topology) for e in experts])

        return set_sharding(census.parameter(local_shape, name, value), spec)

    # -- checkpoints (hf_checkpoint calls these for the parameters of this cell) ----------------

    def read_hf_tensor(self, folder, keys, attr: str):
        """This rank's slice of ``attr`` from a folder in any expert layout (mm_parallel.moe.checkpoint)."""
        from mm_parallel.moe.checkpoint import read_local

        key = next((k for k in keys if k in folder), keys[0])
        value, self.checkpoint_layout = read_local(folder, key[: -len(attr)], attr, self)
        return value

    def hf_tensors(self, key: str, attr: str, full) -> dict:
        """The tensors the save layout stores for the whole ``attr``."""
        from mm_parallel.moe.checkpoint import disk_tensors

        return disk_tensors(key[: -len(attr)], attr, full, self.save_layout or self.checkpoint_layout or "fused")

    def construct(self, tokens, groups):
        if use_fused() and groups.counts.sum():
            return self._grouped_kernel(tokens, groups)
        local, width = self.local, groups.width
        x = ops.gather(tokens, Tensor(groups.padded.astype(np.int32)), 0).reshape(local, width, self.hidden)
        if self.tp_group is not None:
            x = mappings.copy_to_region(x, self.tp_group)
        gate, up = ops.chunk(_expert_matmul(x, self.gate_up_proj), 2, -1)
        y = _expert_matmul(self.act(gate) * up, self.down_proj)
        if self.tp_group is not None:
            y = mappings.reduce_from_region(y, self.tp_group)
        return with_zero_row(y.reshape(local * width, self.hidden))

    def _grouped_kernel(self, tokens, groups):
        """The same outputs from Ascend's grouped matmul over the unpadded rows, expert after expert."""
        width, counts = groups.width, groups.counts
        rows = np.concatenate([groups.padded[e * width:e * width + counts[e]] for e in range(self.local)])
        x = ops.gather(tokens, Tensor(rows.astype(np.int32)), 0)
        if self.tp_group is not None:
            x = mappings.copy_to_region(x, self.tp_group)
        gate_up = _expert_matmul(x, self.gate_up_proj, counts)
        if self.act is silu:  # the fused swiglu kernel: gate and up are the two halves
            hidden = swiglu(gate_up)
        else:
            gate, up = ops.chunk(gate_up, 2, -1)
            hidden = self.act(gate) * up
        y = _expert_matmul(hidden, self.down_proj, counts)
        if self.tp_group is not None:
            y = mappings.reduce_from_region(y, self.tp_group)
        # padding and the last row: the zero row after y's
        padded = np.append(padded_slots(counts, width).reshape(-1), rows.size)
        return ops.gather(with_zero_row(y), Tensor(padded.astype(np.int32)), 0)

    def per_expert_loop(self, tokens, groups):
        """The same outputs expert by expert (the reference benchmarks/moe.py times against)."""
        outputs = []
        for e in range(self.local):
            rows = groups.padded[e * groups.width:(e + 1) * groups.width]
            x = ops.gather(tokens, Tensor(rows.astype(np.int32)), 0)
            gate, up = ops.chunk(ops.matmul(x, self.gate_up_proj[e].T), 2, -1)
            outputs.append(ops.matmul(self.act(gate) * up, self.down_proj[e].T))
        return with_zero_row(ops.concat(outputs, 0))
