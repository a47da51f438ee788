"""The encoders the video generators condition on: UMT5 (text) and CLIP vision (Wan I2V images)."""

from mm_models_video.encoders.clip_vision import CLIPVisionModel
from mm_models_video.encoders.umt5 import UMT5EncoderModel

__all__ = ["CLIPVisionModel", "UMT5EncoderModel"]
