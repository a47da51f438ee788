"""The Qwen2.5-Omni thinker's parallel plan: Qwen2.5-VL's, which covers the audio tower too.

The layout (tp, sp, cp, pp — they decide parameter shapes) is fixed when the model is built with a
topology; the audio tower, like the vision tower, runs whole on the first pipeline stage of every
rank (its sequence is short and cut into 2 n_window-frame chunks). `parallelize` applies recompute
("full" also recomputes the vision blocks and the audio encoder layers), LoRA (PEFT's rule: every
linear named q_proj / k_proj / v_proj / o_proj / gate_proj / up_proj / down_proj — the decoder's,
and the audio encoder's q / k / v, as PEFT with the same target list adapts them) and freezing
("vision", "merger", "language_model", "audio"). See mm_models_vl.qwen2_5_vl.parallel_plan.
"""

from mm_models_vl.qwen2_5_vl.parallel_plan import FREEZABLE, LORA_TARGETS, LoraConfig, parallelize

__all__ = ["FREEZABLE", "LORA_TARGETS", "LoraConfig", "parallelize"]
