"""The CogVideoX parallel plan: recompute and LoRA on top of the layout (mm_models_video.plan).

LoRA targets the attention projections (to_q / to_k / to_v / to_out.0), the modules diffusers'
CogVideoX LoRA training script adapts; the layout (tp, sp, cp, pp) is fixed at construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from mm_models_video.plan import parallelize_blocks
from mm_parallel.lora import LoraConfig as BaseLoraConfig
from mm_parallel.topology import Topology

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


@dataclass
class LoraConfig(BaseLoraConfig):
    target_modules: List[str] = field(default_factory=lambda: list(LORA_TARGETS))


def parallelize(model, topology: Optional[Topology] = None, *, recompute: str = "none",
                recompute_num_layers: Optional[int] = None, lora: Optional[LoraConfig] = None):
    """Apply recomputation and LoRA to a CogVideoXTransformer3DModel (one pipeline chunk); returns it."""
    return parallelize_blocks(model, model.transformer_blocks, topology, recompute=recompute,
                              recompute_num_layers=recompute_num_layers, lora=lora)
