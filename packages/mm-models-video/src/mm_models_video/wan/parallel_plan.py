"""The Wan parallel plan: what a training recipe chooses on top of the layout.

The layout itself (tp, sp, cp, pp — they decide parameter shapes and where the video tokens are
cut) is fixed when the model is built with a topology; `parallelize` then applies the choices that
do not change shapes:

  recompute  "none" | "full" (every block) | "block" (the first ``recompute_num_layers`` blocks
             of this stage) | "selective" (the attention cores: self- and cross-attention)
  lora       PEFT-style adapters on the attention projections (to_q / to_k / to_v / to_out.0 of
             both attentions) and the FFN (ffn.net.0.proj, ffn.net.2), tensor-parallel aware;
             everything else frozen. The names are the ones diffusers' Wan LoRAs use.

ZeRO (`mm_parallel.DistributedOptimizer`) and data parallelism need nothing from the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from mm_parallel.lora import LoraConfig as BaseLoraConfig
from mm_parallel.lora import apply_lora
from mm_parallel.recompute import apply_recompute
from mm_parallel.topology import Topology

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]


@dataclass
class LoraConfig(BaseLoraConfig):
    target_modules: List[str] = field(default_factory=lambda: list(LORA_TARGETS))


def parallelize(model, topology: Optional[Topology] = None, *, recompute: str = "none",
                recompute_num_layers: Optional[int] = None, lora: Optional[LoraConfig] = None):
    """Apply recomputation and LoRA to a WanTransformer3DModel (one pipeline chunk); returns it.

    ``topology``, if given, must be the one the model was built with (the layout decides the
    parameter shapes, so it cannot change after construction)."""
    if topology is not None and topology is not model.topology:
        raise ValueError("parallelize got a topology other than the model's: build the model under the layout "
                         "you want, e.g. WanTransformer3DModel.from_pretrained(path, topology)")
    if len(model.blocks):
        apply_recompute(list(model.blocks), recompute, recompute_num_layers)
    if lora is not None:
        apply_lora(model, lora.target_modules, lora.r, lora.alpha, lora.dropout)
    return model
