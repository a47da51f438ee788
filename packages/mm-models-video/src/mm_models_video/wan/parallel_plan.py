"""The Wan parallel plan (2.1 and 2.2, a WanExperts' experts alike): what a training recipe
chooses on top of the layout.

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

from mm_models_video.plan import parallelize_blocks
from mm_models_video.wan.experts import WanExperts
from mm_parallel.lora import LoraConfig as BaseLoraConfig
from mm_parallel.topology import Topology

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]


@dataclass
class LoraConfig(BaseLoraConfig):
    target_modules: List[str] = field(default_factory=lambda: list(LORA_TARGETS))


def parallelize(model, topology: Optional[Topology] = None, *, recompute: str = "none",
                recompute_num_layers: Optional[int] = None, lora: Optional[LoraConfig] = None):
    """Apply recomputation and LoRA to a WanTransformer3DModel (one pipeline chunk), or to each
    expert of a WanExperts; returns it (mm_models_video.plan.parallelize_blocks)."""
    for expert in model.experts if isinstance(model, WanExperts) else [model]:
        parallelize_blocks(expert, expert.blocks, topology, recompute=recompute,
                           recompute_num_layers=recompute_num_layers, lora=lora)
    return model
