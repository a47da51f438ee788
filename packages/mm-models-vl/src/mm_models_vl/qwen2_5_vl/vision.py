"""Qwen2.5-VL vision tower: 3-D patch embedding, 2-D rotary, window / full attention blocks, patch merger.

Parameter names are transformers' (``model.visual.*``). The tower runs whole on every rank
(it is small next to the language model); its patches are one packed sequence, so attention is
segment-masked: within a window for most blocks, within a frame for ``fullatt_block_indexes``.
"""

from __future__ import annotations

import numpy as np
from mindspore import Tensor, nn, ops

from mm_models_vl.qwen2_5_vl import positions as pos
from mm_parallel import ops as kernels
from mm_parallel.blocks import Activation, GatedMLP, Linear, PatchConv, RMSNorm


class Qwen2_5_VisionPatchEmbed(nn.Cell):
    """(num_patches, C * T * P * P) flattened patches -> (num_patches, hidden): Conv3d, stride = kernel
    (without bias in Qwen2.5-VL, with one in Qwen3-VL)."""

    def __init__(self, config, bias: bool = False):
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = PatchConv(config.in_channels, config.hidden_size, kernel, bias=bias)

    def construct(self, pixel_values):
        return self.proj(pixel_values)


class Qwen2_5_VLVisionAttention(nn.Cell):
    """Fused-qkv self-attention over the packed patch sequence, split into segments by cu_seqlens."""

    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.qkv = Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = Linear(config.hidden_size, config.hidden_size, bias=True)

    def construct(self, x, segment_ids, cos, sin):
        n = x.shape[0]
        heads = self.num_heads
        qkv = self.qkv(x).reshape(1, n, 3, heads, self.head_dim)
        # queries and keys rotate alike: one call on both (half the rotary ops of two calls)
        qk = kernels.apply_rotary(qkv[:, :, :2].reshape(1, n, 2 * heads, self.head_dim), cos, sin)
        out = kernels.attention(qk[:, :, :heads], qk[:, :, heads:], qkv[:, :, 2], segment_ids=segment_ids)
        return self.proj(out.reshape(n, -1))


class Qwen2_5_VLVisionBlock(nn.Cell):
    attention_class = Qwen2_5_VLVisionAttention  # (config) -> the block's self-attention

    def __init__(self, config):
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, eps=1e-6)
        self.norm2 = RMSNorm(config.hidden_size, eps=1e-6)
        self.attn = self.attention_class(config)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=True,
                            tensor_parallel=False)

    def construct(self, x, segment_ids, cos, sin):
        x = x + self.attn(self.norm1(x), segment_ids, cos, sin)
        return x + self.mlp(self.norm2(x))


class Qwen2_5_VLPatchMerger(nn.Cell):
    """RMSNorm, then each merge x merge block of patches concatenated -> MLP -> language hidden size."""

    def __init__(self, dim: int, context_dim: int, spatial_merge_size: int):
        super().__init__()
        self.hidden_size = context_dim * spatial_merge_size ** 2
        self.ln_q = RMSNorm(context_dim, eps=1e-6)
        self.mlp = nn.SequentialCell([Linear(self.hidden_size, self.hidden_size), Activation("gelu"),
                                      Linear(self.hidden_size, dim)])

    def construct(self, x):
        return self.mlp(self.ln_q(x).reshape(-1, self.hidden_size))


def _segments(bounds: np.ndarray) -> np.ndarray:
    """(1, n) segment ids from cumulative boundaries, kept on the host: attention reads them there
    (the reference path's mask, the fused kernel's actual_seq_qlen), so a device copy would only
    be read back (a device-to-host round trip per block on Ascend)."""
    return np.repeat(np.arange(len(bounds) - 1, dtype=np.int32), np.diff(bounds))[None, :]


class Qwen2_5_VisionTransformerPretrainedModel(nn.Cell):
    """pixel_values (num_patches, C*T*P*P) and grid_thw (n, 3) -> (num_patches / merge^2, out_hidden_size)."""

    block_class = Qwen2_5_VLVisionBlock  # (config) -> one transformer block

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.merge = config.spatial_merge_size
        self.unit = self.merge ** 2
        self.head_dim = config.hidden_size // config.num_heads
        rope = config.rope_parameters or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"the vision tower supports axial rotary only, config has {rope.get('rope_type')!r}")
        self.theta = rope.get("rope_theta", 10000.0)
        self.patch_embed = Qwen2_5_VisionPatchEmbed(config)
        self.blocks = nn.CellList([self.block_class(config) for _ in range(config.depth)])
        self.merger = Qwen2_5_VLPatchMerger(config.out_hidden_size, config.hidden_size, self.merge)
        self.fullatt_block_indexes = set(config.fullatt_block_indexes)

    def layout(self, grid_thw):
        """Host-side plan of one forward: window order, its inverse, segments, rotary tables."""
        grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
        order, window_bounds = pos.window_index(grid, self.merge, self.config.window_size, self.config.patch_size)
        patch_order = (order[:, None] * self.unit + np.arange(self.unit)).reshape(-1)  # merged -> patch order
        cos, sin = pos.vision_cos_sin(pos.vision_rotary_positions(grid, self.merge), self.head_dim, self.theta)
        frames = pos.frame_cu_seqlens(grid)
        # frame segments are contiguous in window order too: windows never cross frames
        return dict(patch_order=Tensor(patch_order.astype(np.int32)),
                    restore=Tensor(np.argsort(order).astype(np.int32)),
                    window_segments=_segments(window_bounds), frame_segments=_segments(frames),
                    cos=Tensor(cos[patch_order]), sin=Tensor(sin[patch_order]))

    def construct(self, pixel_values, grid_thw):
        plan = self.layout(grid_thw)
        if pixel_values.shape[0] != plan["patch_order"].shape[0]:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, the grids describe "
                             f"{plan['patch_order'].shape[0]}")
        x = ops.gather(self.patch_embed(pixel_values), plan["patch_order"], 0)
        for i, block in enumerate(self.blocks):
            segments = plan["frame_segments"] if i in self.fullatt_block_indexes else plan["window_segments"]
            x = block(x, segments, plan["cos"], plan["sin"])
        return ops.gather(self.merger(x), plan["restore"], 0)
