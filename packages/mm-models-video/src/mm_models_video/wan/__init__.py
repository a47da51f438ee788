"""Wan2.1 and Wan2.2: the diffusion transformer (T2V, I2V, TI2V), Wan2.2's pair of experts, the
parallel plan and checkpoints, and the VAEs."""

from mm_models_video.wan.config import WanTransformerConfig
from mm_models_video.wan.experts import WanExperts
from mm_models_video.wan.modeling import Transformer3DOutput, WanTransformer3DModel
from mm_models_video.wan.vae import AutoencoderKLWan

__all__ = ["AutoencoderKLWan", "Transformer3DOutput", "WanExperts", "WanTransformer3DModel", "WanTransformerConfig"]
