"""What a video DiT's parallel plan applies once the model is built (shared by the families).

The layout itself (tp, sp, cp, pp — they decide parameter shapes and where the tokens are cut) is
fixed when the model is built with a topology; `parallelize_blocks` then applies the choices that
do not change shapes:

  recompute  "none" | "full" (every block) | "block" (the first ``recompute_num_layers`` blocks
             of this stage) | "selective" (the attention cores)
  lora       PEFT-style adapters on the family's target linears, tensor-parallel aware;
             everything else frozen

ZeRO (`mm_parallel.DistributedOptimizer`) and data parallelism need nothing from the model.
"""

from __future__ import annotations

from typing import Optional

from mm_parallel.lora import apply_lora
from mm_parallel.recompute import apply_recompute
from mm_parallel.topology import Topology


def parallelize_blocks(model, blocks, topology: Optional[Topology] = None, *, recompute: str = "none",
                       recompute_num_layers: Optional[int] = None, lora=None):
    """Apply recomputation to ``blocks`` (this chunk's) and LoRA (a LoraConfig) to ``model``;
    returns the model. ``topology``, if given, must be the one the model was built with."""
    if topology is not None and topology is not model.topology:
        raise ValueError(f"parallelize got a topology other than the model's: build the model under the layout you "
                         f"want, e.g. {type(model).__name__}.from_pretrained(path, topology)")
    if len(blocks):
        apply_recompute(list(blocks), recompute, recompute_num_layers)
    if lora is not None:
        apply_lora(model, lora.target_modules, lora.r, lora.alpha, lora.dropout)
    return model
