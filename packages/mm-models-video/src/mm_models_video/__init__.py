"""MindSpore twins of the diffusers video generators.

    from mm_models_video import WanTransformer3DModel
    model = WanTransformer3DModel.from_pretrained("path/to/Wan2.1-T2V-1.3B-Diffusers/transformer", topology)

Wan2.1's diffusion transformer (T2V, I2V) is implemented; its VAE, UMT5 and CLIP encoders and
CogVideoX come with later work (see the package README).
"""

from mm_models_video.__about__ import __version__
from mm_models_video.wan import Transformer3DOutput, WanTransformer3DModel, WanTransformerConfig

__all__ = ["Transformer3DOutput", "WanTransformer3DModel", "WanTransformerConfig", "__version__"]
