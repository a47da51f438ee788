"""CogVideoX 1.0 / 1.5 (T2V, I2V): the diffusion transformer, its positions, its v-prediction
objective and samplers, its VAE."""

from mm_models_video.cogvideox.config import CogVideoXTransformerConfig
from mm_models_video.cogvideox.modeling import CogVideoXTransformer3DModel
from mm_models_video.cogvideox.objective import CogVideoXSchedule
from mm_models_video.cogvideox.positions import rotary_tables
from mm_models_video.cogvideox.vae import AutoencoderKLCogVideoX

__all__ = ["AutoencoderKLCogVideoX", "CogVideoXSchedule", "CogVideoXTransformer3DModel", "CogVideoXTransformerConfig",
           "rotary_tables"]
