"""Vision-language preprocessing: drop-in twins of transformers' Qwen2-VL processors (numpy out)."""

from mm_data.vl.image_processor import Qwen2VLImageProcessor, smart_resize

__all__ = ["Qwen2VLImageProcessor", "smart_resize"]
