"""The encoders the video generators condition on: T5 (CogVideoX) and UMT5 (Wan) text, CLIP
vision (Wan I2V images)."""

from mm_models_video.encoders.clip_vision import CLIPVisionModel
from mm_models_video.encoders.t5 import T5EncoderModel, UMT5EncoderModel

__all__ = ["CLIPVisionModel", "T5EncoderModel", "UMT5EncoderModel"]
