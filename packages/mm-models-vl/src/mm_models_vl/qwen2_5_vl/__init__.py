"""Qwen2.5-VL: vision tower, M-RoPE language model, checkpoints in transformers' format."""

from mm_models_vl.qwen2_5_vl.modeling import CausalLMOutput, Qwen2_5_VLForConditionalGeneration, load_config

__all__ = ["CausalLMOutput", "Qwen2_5_VLForConditionalGeneration", "load_config"]
