"""Qwen2.5-Omni's vision tower: Qwen2.5-VL's (mm_models_vl.qwen2_5_vl.vision), whose attention
keeps separate ``q`` / ``k`` / ``v`` projections where Qwen2.5-VL fuses them into ``qkv``."""

from __future__ import annotations

from mindspore import nn, ops

from mm_models_vl.qwen2_5_vl.vision import Qwen2_5_VisionTransformerPretrainedModel, Qwen2_5_VLVisionBlock
from mm_parallel import ops as kernels
from mm_parallel.blocks import Linear


class Qwen2_5OmniVisionAttention(nn.Cell):
    """Self-attention over the packed patch sequence, split into segments (windows or frames)."""

    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        dim = config.hidden_size
        self.q, self.k, self.v = Linear(dim, dim), Linear(dim, dim), Linear(dim, dim)
        self.proj = Linear(dim, dim)

    def construct(self, x, segment_ids, cos, sin):
        n, heads = x.shape[0], self.num_heads
        shape = (1, n, heads, self.head_dim)
        # queries and keys rotate alike: one call on both
        qk = kernels.apply_rotary(ops.concat([self.q(x).reshape(shape), self.k(x).reshape(shape)], 2), cos, sin)
        out = kernels.attention(qk[:, :, :heads], qk[:, :, heads:], self.v(x).reshape(shape), segment_ids=segment_ids)
        return self.proj(out.reshape(n, -1))


class Qwen2_5OmniVisionBlock(Qwen2_5_VLVisionBlock):
    attention_class = Qwen2_5OmniVisionAttention


class Qwen2_5OmniVisionEncoder(Qwen2_5_VisionTransformerPretrainedModel):
    """pixel_values (num_patches, C*T*P*P) and grid_thw (n, 3) -> (num_patches / merge^2, out_hidden_size)."""

    block_class = Qwen2_5OmniVisionBlock
