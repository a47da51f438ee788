"""Activation recomputation: keep fewer activations, run the forward of a part again in backward.

Modes (Megatron's names):
  full       every layer is recomputed: only each layer's input is kept.
  block      the first ``num_layers`` of the L layers are recomputed, the rest keep everything
             (spend the memory you have on the last layers, whose activations live shortest).
  selective  only the attention core (scores, softmax, weighted sum: the O(seq^2) part) is
             recomputed, in every layer; the cheap-to-keep linear activations stay.

A recomputed part is a Cell marked with MindSpore's ``Cell.recompute()``. Selective recompute
finds the `CoreAttention` cells inside each layer, so a model that wants it computes attention
through `CoreAttention`.

Measured on MindSpore 2.7.2 CPU (PyNative, mccl): with more than one process, recomputing a layer
that holds tensor-parallel collectives makes the backward's collectives fail ("AllGather failed")
and gives wrong results; after a recomputed step, later steps in the same process can give wrong
gradients without an error. Until that is solved, `apply_recompute` refuses multi-process CPU runs
instead of corrupting them.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mindspore as ms
from mindspore import nn

from mm_parallel.context_parallel import attention
from mm_parallel.topology import Topology, get_topology

RECOMPUTE_MODES = ("none", "full", "block", "selective")


class CoreAttention(nn.Cell):
    """The attention core as a Cell: `mm_parallel.attention` (context parallel included)."""

    def __init__(self, causal: bool = False, scale: Optional[float] = None, topology: Optional[Topology] = None):
        super().__init__()
        self.causal, self.scale, self.topology = causal, scale, topology

    def construct(self, q, k, v):
        return attention(q, k, v, causal=self.causal, scale=self.scale, topology=self.topology)


def recompute(cell: nn.Cell) -> nn.Cell:
    """Mark ``cell`` to be recomputed in the backward; returns it."""
    cell.recompute()
    return cell


def apply_recompute(layers: Sequence[nn.Cell], mode: str, num_layers: Optional[int] = None,
                    topology: Optional[Topology] = None) -> int:
    """Apply a recompute mode to a model's list of layers; returns how many cells were marked."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode {mode!r} is unknown; use one of {', '.join(RECOMPUTE_MODES)}")
    layers = list(layers)
    if mode == "none":
        return 0
    if get_topology(topology).world_size > 1 and ms.get_context("device_target") == "CPU":
        raise RuntimeError(
            "recompute with more than one process is not supported on CPU with MindSpore 2.7.2: the recomputed "
            "backward's collectives fail or give wrong gradients (see mm_parallel.recompute); set recompute to "
            "'none' for multi-process CPU runs"
        )
    if mode == "full":
        targets = layers
    elif mode == "block":
        if num_layers is None or not 0 < num_layers <= len(layers):
            raise ValueError(
                f"block recompute needs num_layers between 1 and the layer count {len(layers)}, got {num_layers}"
            )
        targets = layers[:num_layers]
    else:
        targets = [cell for layer in layers for _, cell in layer.cells_and_names() if isinstance(cell, CoreAttention)]
        if not targets:
            raise ValueError(
                "selective recompute found no CoreAttention inside the layers; compute attention through "
                "mm_parallel.recompute.CoreAttention or use mode='full' / 'block'"
            )
    for cell in targets:
        recompute(cell)
    return len(targets)
