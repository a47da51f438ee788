"""Qwen3-VL (dense) and Qwen3-VL-MoE: DeepStack vision tower, interleaved M-RoPE language model,
MoE decoder layers through mm_parallel.moe, checkpoints in transformers' format."""

from mm_models_vl.qwen3_vl.modeling import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

__all__ = ["Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"]
