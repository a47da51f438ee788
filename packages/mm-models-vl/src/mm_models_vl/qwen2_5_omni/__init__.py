"""Qwen2.5-Omni thinker: audio encoder, vision tower, TMRoPE language model, checkpoints in transformers' format."""

from mm_models_vl.qwen2_5_omni.modeling import Qwen2_5OmniThinkerForConditionalGeneration, thinker_config

__all__ = ["Qwen2_5OmniThinkerForConditionalGeneration", "thinker_config"]
