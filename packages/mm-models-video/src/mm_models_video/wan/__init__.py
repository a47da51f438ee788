"""Wan2.1: the diffusion transformer (T2V, I2V), its parallel plan and checkpoints, and the VAE."""

from mm_models_video.wan.config import WanTransformerConfig
from mm_models_video.wan.modeling import Transformer3DOutput, WanTransformer3DModel
from mm_models_video.wan.vae import AutoencoderKLWan

__all__ = ["AutoencoderKLWan", "Transformer3DOutput", "WanTransformer3DModel", "WanTransformerConfig"]
