"""MindSpore twins of the transformers vision-language models (Qwen2.5-VL, Qwen2.5-Omni thinker, Qwen3-VL, Qwen3-VL-MoE).

Skeleton only: the implementation arrives with issue 5; nothing here works yet.
"""

from mm_models_vl.__about__ import __version__

__all__ = ["__version__"]
