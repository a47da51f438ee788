"""WanTransformerConfig: the fields of diffusers' WanTransformer3DModel config.json, typed
(reading and writing: mm_models_video.diffusers_config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

from mm_models_video.diffusers_config import DiffusersConfig

CLASS_NAME = "WanTransformer3DModel"


@dataclass
class WanTransformerConfig(DiffusersConfig):
    CLASS_NAME = CLASS_NAME

    patch_size: Tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: Optional[int] = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    qk_norm: Optional[str] = "rms_norm_across_heads"
    eps: float = 1e-6
    image_dim: Optional[int] = None  # I2V: CLIP image-embedding width (1280)
    added_kv_proj_dim: Optional[int] = None  # I2V: the image keys / values' input width
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: Optional[int] = None  # FLF2V: learned positions of the two images' tokens
    extra: dict = field(default_factory=dict, repr=False)  # diffusers bookkeeping, kept for saving

    def __post_init__(self):
        self.patch_size = tuple(int(p) for p in self.patch_size)
        if len(self.patch_size) != 3:
            raise ValueError(f"patch_size must be (t, h, w), got {self.patch_size}")
        if self.qk_norm not in (None, "rms_norm_across_heads"):
            raise ValueError(f"qk_norm={self.qk_norm!r} is not supported; Wan2.1 uses 'rms_norm_across_heads'")
        if self.out_channels is None:
            self.out_channels = self.in_channels
        if (self.image_dim is None) != (self.added_kv_proj_dim is None):
            raise ValueError("an I2V model needs both image_dim and added_kv_proj_dim (T2V: neither)")
        if self.added_kv_proj_dim is not None and self.added_kv_proj_dim != self.inner_dim:
            raise ValueError(f"added_kv_proj_dim={self.added_kv_proj_dim} must equal the model width "
                             f"num_attention_heads x attention_head_dim = {self.inner_dim}: the image keys / values "
                             "are projected from the embedded image tokens")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim
