"""CogVideoXTransformerConfig: the fields of diffusers' CogVideoXTransformer3DModel config.json.

The published checkpoints differ in a few of them:

    1.0 2B       sincos positions (use_rotary_positional_embeddings false), no patch_size_t
    1.0 5B       rotary positions; I2V adds use_learned_positional_embeddings (the checkpoint's
                 patch_embed.pos_embedding) and in_channels 32 (image latents on the channels)
    1.5 5B       rotary, patch_size_t 2 (3-D patches through a linear), patch_bias false;
                 I2V adds ofs_embed_dim (the ``ofs`` condition)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mm_models_video.diffusers_config import DiffusersConfig


@dataclass
class CogVideoXTransformerConfig(DiffusersConfig):
    CLASS_NAME = "CogVideoXTransformer3DModel"

    num_attention_heads: int = 30
    attention_head_dim: int = 64
    in_channels: int = 16
    out_channels: Optional[int] = 16
    flip_sin_to_cos: bool = True
    freq_shift: int = 0
    time_embed_dim: int = 512
    ofs_embed_dim: Optional[int] = None
    text_embed_dim: int = 4096
    num_layers: int = 30
    dropout: float = 0.0
    attention_bias: bool = True
    sample_width: int = 90
    sample_height: int = 60
    sample_frames: int = 49
    patch_size: int = 2
    patch_size_t: Optional[int] = None
    temporal_compression_ratio: int = 4
    max_text_seq_length: int = 226
    activation_fn: str = "gelu-approximate"
    timestep_activation_fn: str = "silu"
    norm_elementwise_affine: bool = True
    norm_eps: float = 1e-5
    spatial_interpolation_scale: float = 1.875
    temporal_interpolation_scale: float = 1.0
    use_rotary_positional_embeddings: bool = False
    use_learned_positional_embeddings: bool = False
    patch_bias: bool = True
    extra: dict = field(default_factory=dict, repr=False)  # diffusers bookkeeping, kept for saving

    def __post_init__(self):
        if self.out_channels is None:
            self.out_channels = self.in_channels
        if self.use_learned_positional_embeddings and not self.use_rotary_positional_embeddings:
            raise ValueError("use_learned_positional_embeddings needs use_rotary_positional_embeddings "
                             "(no CogVideoX checkpoint has learned positions without rotary ones; diffusers "
                             "refuses it)")
        if self.dropout:
            raise ValueError(f"dropout={self.dropout} is not supported (every CogVideoX checkpoint trains with 0.0)")
        if self.activation_fn != "gelu-approximate" or self.timestep_activation_fn != "silu":
            raise ValueError(f"activation_fn={self.activation_fn!r} / timestep_activation_fn="
                             f"{self.timestep_activation_fn!r}: CogVideoX uses 'gelu-approximate' and 'silu'")
        if self.ofs_embed_dim and self.ofs_embed_dim != self.time_embed_dim:
            raise ValueError(f"ofs_embed_dim={self.ofs_embed_dim} must equal time_embed_dim={self.time_embed_dim}: "
                             "the two embeddings are added")
        if self.inner_dim % 16 and not self.use_rotary_positional_embeddings:
            raise ValueError(f"sincos positions need the width ({self.inner_dim}) divisible by 16")
        if self.use_rotary_positional_embeddings and self.attention_head_dim % 16:
            raise ValueError(f"rotary positions need attention_head_dim ({self.attention_head_dim}) divisible by 16 "
                             "(a quarter for time, 3/8 each for height and width, each even)")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def version(self) -> str:
        """"1.0" (2-D patches per frame) or "1.5" (3-D patches of patch_size_t frames)."""
        return "1.0" if self.patch_size_t is None else "1.5"

    @property
    def patch_volume(self) -> int:
        return self.patch_size ** 2 * (self.patch_size_t or 1)

    @property
    def uses_positional_table(self) -> bool:
        """Whether sincos or learned positions are added to the joint tokens (diffusers' rule)."""
        return not self.use_rotary_positional_embeddings or self.use_learned_positional_embeddings
