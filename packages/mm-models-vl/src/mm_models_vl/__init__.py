"""MindSpore twins of the transformers vision-language models.

    from mm_models_vl import Qwen2_5_VLForConditionalGeneration
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained("path/to/Qwen2.5-VL-7B-Instruct", topology)

Qwen2.5-VL, the Qwen2.5-Omni thinker and Qwen3-VL (dense and MoE).
"""

from mm_models_vl.__about__ import __version__
from mm_models_vl.qwen2_5_omni import Qwen2_5OmniThinkerForConditionalGeneration
from mm_models_vl.qwen2_5_vl import CausalLMOutput, Qwen2_5_VLForConditionalGeneration
from mm_models_vl.qwen3_vl import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

__all__ = ["CausalLMOutput", "Qwen2_5OmniThinkerForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
           "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration", "__version__"]
