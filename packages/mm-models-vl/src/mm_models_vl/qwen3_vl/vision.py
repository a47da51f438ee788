"""Qwen3-VL vision tower: patch embedding with learned positions resampled to each grid, LayerNorm
ViT blocks attending within each frame, a patch merger, and DeepStack mergers.

    x      = patch_embed(pixels) + sum_k w_k pos_embed[row_k]        (4 bilinear taps, positions.py)
    x      = block_i(x)   for i < depth;   deep_j = deepstack_merger_j(x) after block deepstack_visual_indexes[j]
    merged = merger(x)                                              (LayerNorm, merge^2 patches -> MLP)

A DeepStack merger normalises after the merge^2 patches are concatenated (``use_postshuffle_norm``),
the final merger before. The attention is Qwen2.5-VL's vision attention (fused qkv, 2-D rotary,
segments = frames). Names are transformers' (``model.visual.*``); the tower runs whole on every
rank, like Qwen2.5-VL's.
"""

from __future__ import annotations

import numpy as np
from mindspore import Tensor, nn, ops

from mm_models_vl.qwen2_5_vl.vision import Qwen2_5_VisionPatchEmbed, Qwen2_5_VLVisionAttention, _segments
from mm_models_vl.qwen3_vl import positions as pos
from mm_parallel.blocks import Activation, LayerNorm, Linear
from mm_parallel.ops.low_precision import compute_weight
from mm_parallel.tensor_parallel import new_parameter


class Qwen3VLVisionMLP(nn.Cell):
    def __init__(self, config):
        super().__init__()
        self.linear_fc1 = Linear(config.hidden_size, config.intermediate_size)
        self.linear_fc2 = Linear(config.intermediate_size, config.hidden_size)
        self.act_fn = Activation(config.hidden_act)

    def construct(self, x):
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class Qwen3VLVisionBlock(nn.Cell):
    def __init__(self, config):
        super().__init__()
        self.norm1 = LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = Qwen2_5_VLVisionAttention(config)
        self.mlp = Qwen3VLVisionMLP(config)

    def construct(self, x, segment_ids, cos, sin):
        x = x + self.attn(self.norm1(x), segment_ids, cos, sin)
        return x + self.mlp(self.norm2(x))


class Qwen3VLVisionPatchMerger(nn.Cell):
    """LayerNorm (over one patch, or over the merge^2 concatenated with ``use_postshuffle_norm``),
    then linear_fc1 -> GELU (exact) -> linear_fc2 to the language model's hidden size."""

    def __init__(self, config, use_postshuffle_norm: bool = False):
        super().__init__()
        self.hidden_size = config.hidden_size * config.spatial_merge_size ** 2
        self.use_postshuffle_norm = use_postshuffle_norm
        self.norm = LayerNorm(self.hidden_size if use_postshuffle_norm else config.hidden_size, eps=1e-6)
        self.linear_fc1 = Linear(self.hidden_size, self.hidden_size)
        self.act_fn = Activation("gelu")
        self.linear_fc2 = Linear(self.hidden_size, config.out_hidden_size)

    def construct(self, x):
        x = self.norm(x.reshape(-1, self.hidden_size)) if self.use_postshuffle_norm else \
            self.norm(x).reshape(-1, self.hidden_size)
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class _PositionTable(nn.Cell):
    """torch's nn.Embedding as a plain table (``weight``), read by a weighted gather."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.weight = new_parameter((rows, dim), "weight", None, None)

    def construct(self, index, weights):
        taps = ops.gather(compute_weight(self.weight), index.reshape(-1), 0).reshape(index.shape[0], index.shape[1], -1)
        return (taps * weights[:, :, None]).sum(1)


class Qwen3VLVisionModel(nn.Cell):
    """pixel_values (num_patches, C*T*P*P) and grid_thw (n, 3) -> (merged features
    (num_patches / merge^2, out_hidden_size), [DeepStack features of the same shape, one per index])."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.merge = config.spatial_merge_size
        self.head_dim = config.hidden_size // config.num_heads
        rope = config.rope_parameters or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"the vision tower supports axial rotary only, config has {rope.get('rope_type')!r}")
        self.theta = rope.get("rope_theta", 10000.0)
        self.patch_embed = Qwen2_5_VisionPatchEmbed(config, bias=True)
        self.pos_embed = _PositionTable(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.CellList([Qwen3VLVisionBlock(config) for _ in range(config.depth)])
        self.merger = Qwen3VLVisionPatchMerger(config)
        self.deepstack_visual_indexes = list(config.deepstack_visual_indexes)
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < config.depth]
        if bad:
            raise ValueError(f"deepstack_visual_indexes {bad} are not blocks of a depth-{config.depth} tower")
        self.deepstack_merger_list = nn.CellList(
            [Qwen3VLVisionPatchMerger(config, use_postshuffle_norm=True) for _ in self.deepstack_visual_indexes])

    def layout(self, grid_thw):
        """Host-side plan of one forward: position taps, frame segments, rotary tables."""
        grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
        index, weights = pos.position_embedding_taps(grid, self.config.num_position_embeddings, self.merge)
        cos, sin = pos.vision_cos_sin(pos.vision_rotary_positions(grid, self.merge), self.head_dim, self.theta)
        return dict(taps=Tensor(index.astype(np.int32)), tap_weights=Tensor(weights),
                    segments=_segments(pos.frame_cu_seqlens(grid)), cos=Tensor(cos), sin=Tensor(sin))

    def construct(self, pixel_values, grid_thw):
        plan = self.layout(grid_thw)
        if pixel_values.shape[0] != plan["taps"].shape[0]:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, the grids describe "
                             f"{plan['taps'].shape[0]}")
        x = self.patch_embed(pixel_values) + self.pos_embed(plan["taps"], plan["tap_weights"])
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, plan["segments"], plan["cos"], plan["sin"])
            if i in self.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deepstack
