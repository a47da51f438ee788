"""CogVideoX 1.0 / 1.5 (T2V, I2V): the diffusion transformer and its positions."""

from mm_models_video.cogvideox.config import CogVideoXTransformerConfig
from mm_models_video.cogvideox.modeling import CogVideoXTransformer3DModel
from mm_models_video.cogvideox.positions import rotary_tables

__all__ = ["CogVideoXTransformer3DModel", "CogVideoXTransformerConfig", "rotary_tables"]
