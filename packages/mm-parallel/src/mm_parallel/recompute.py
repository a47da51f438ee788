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

Collectives inside a recomputed part run again in the backward, in the same order on every
rank; tests check full / block / selective recompute under tp, sp and cp on several processes.
(An earlier multi-process failure here was MindSpore skipping custom bprops under asynchronous
launch, fixed for every Cell by mm_parallel.runtime.)
"""

from __future__ import annotations

from typing import Optional, Sequence

from mindspore import nn

from mm_parallel.context_parallel import attention
from mm_parallel.ops import attention as local_attention
from mm_parallel.topology import Topology

RECOMPUTE_MODES = ("none", "full", "block", "selective")


class CoreAttention(nn.Cell):
    """The attention core as a Cell: `mm_parallel.attention` (context parallel included).

    ``context_parallel=False`` attends locally whatever the topology: cross-attention, whose
    queries are this rank's part of the sequence and whose keys (text, image tokens) are whole."""

    def __init__(self, causal: bool = False, scale: Optional[float] = None, topology: Optional[Topology] = None,
                 context_parallel: bool = True):
        super().__init__()
        self.causal, self.scale, self.topology = causal, scale, topology
        self.context_parallel = context_parallel

    def construct(self, q, k, v, key_padding_mask=None, key_length=None, segment_ids=None):
        if not self.context_parallel:
            return local_attention(q, k, v, causal=self.causal, scale=self.scale, key_padding_mask=key_padding_mask,
                                   segment_ids=segment_ids)
        return attention(q, k, v, causal=self.causal, scale=self.scale, key_padding_mask=key_padding_mask,
                         key_length=key_length, segment_ids=segment_ids, topology=self.topology)


def recompute(cell: nn.Cell) -> nn.Cell:
    """Mark ``cell`` to be recomputed in the backward; returns it."""
    cell.recompute()
    return cell


def apply_recompute(layers: Sequence[nn.Cell], mode: str, num_layers: Optional[int] = None) -> int:
    """Apply a recompute mode to a model's list of layers; returns how many cells were marked."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode {mode!r} is unknown; use one of {', '.join(RECOMPUTE_MODES)}")
    layers = list(layers)
    if mode == "none":
        return 0
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
