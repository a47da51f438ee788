"""MindSpore twins of the diffusers video generators.

    from mm_models_video import WanTransformer3DModel
    model = WanTransformer3DModel.from_pretrained("path/to/Wan2.1-T2V-1.3B-Diffusers/transformer", topology)

Wan2.1 and Wan2.2: the diffusion transformer (T2V, I2V, TI2V's per-token timesteps), the A14B
pair of experts (WanExperts), the VAEs (2.2's residual, patchified one), the UMT5 text and CLIP
vision encoders they condition on, and the flow-matching objective. CogVideoX 1.0 / 1.5: the
diffusion transformer (T2V, I2V, every layout), its positions, VAE, T5 encoder, v-prediction
objective and samplers.
"""

from mm_models_video.__about__ import __version__
from mm_models_video.cogvideox import (
    AutoencoderKLCogVideoX,
    CogVideoXTransformer3DModel,
    CogVideoXTransformerConfig,
)
from mm_models_video.encoders import CLIPVisionModel, T5EncoderModel, UMT5EncoderModel
from mm_models_video.wan import (
    AutoencoderKLWan,
    Transformer3DOutput,
    WanExperts,
    WanTransformer3DModel,
    WanTransformerConfig,
)

__all__ = ["AutoencoderKLCogVideoX", "AutoencoderKLWan", "CLIPVisionModel", "CogVideoXTransformer3DModel",
           "CogVideoXTransformerConfig", "T5EncoderModel", "Transformer3DOutput", "UMT5EncoderModel",
           "WanExperts", "WanTransformer3DModel", "WanTransformerConfig", "__version__"]
