"""MindSpore twins of the transformers vision-language models.

    from mm_models_vl import Qwen2_5_VLForConditionalGeneration
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained("path/to/Qwen2.5-VL-7B-Instruct", topology)

Qwen2.5-VL is implemented; Qwen2.5-Omni thinker and Qwen3-VL (dense, MoE) come with later issues.
"""

from mm_models_vl.__about__ import __version__
from mm_models_vl.qwen2_5_vl import CausalLMOutput, Qwen2_5_VLForConditionalGeneration

__all__ = ["CausalLMOutput", "Qwen2_5_VLForConditionalGeneration", "__version__"]
