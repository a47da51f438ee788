"""The Qwen3-VL (dense and MoE) parallel plan: Qwen2.5-VL's, which fits both unchanged.

The layout (tp, sp, cp, pp, ep — they decide parameter shapes) is fixed when the model is built
with a topology; `parallelize` applies recompute ("full" also recomputes the vision blocks),
LoRA (PEFT-style on q/k/v/o and the dense MLPs' gate/up/down; the fused experts take none) and
freezing ("vision", "merger" — the merger and the DeepStack mergers —, "language_model"). See
mm_models_vl.qwen2_5_vl.parallel_plan.
"""

from mm_models_vl.qwen2_5_vl.parallel_plan import FREEZABLE, LORA_TARGETS, LoraConfig, parallelize

__all__ = ["FREEZABLE", "LORA_TARGETS", "LoraConfig", "parallelize"]
