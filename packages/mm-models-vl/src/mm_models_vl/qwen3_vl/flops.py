"""Forward FLOPs of Qwen3-VL and Qwen3-VL-MoE (for MFU), from the config and the inputs' shapes.

Only matrix products count (mm_profiling.flops' convention). The vision tower is a ViT with a
plain two-layer MLP attending within each frame, plus one merger per DeepStack level; the
language model a decoder with the config's head_dim whose MoE layers cost the router and top_k
experts per token (what is computed, not what is stored).
"""

from __future__ import annotations

import numpy as np

from mm_models_vl.qwen2_5_vl.flops import per_sample_flops
from mm_models_vl.qwen3_vl import positions as pos
from mm_models_vl.qwen3_vl.language import is_sparse_layer
from mm_profiling.flops import decoder_lm_flops, matmul, vit_flops


def vision_flops(config, grids) -> int:
    """The tower (patch embedding, blocks, merger and DeepStack mergers) over ``grids`` (n, 3)."""
    vision = config.vision_config
    grids = np.asarray(grids, np.int64).reshape(-1, 3)
    if not len(grids):
        return 0
    frames = np.diff(pos.frame_cu_seqlens(grids)).tolist()
    patches = int(np.prod(grids, axis=1).sum())
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    total = vit_flops(patches, patch_dim, vision.hidden_size, vision.num_heads, vision.intermediate_size,
                      [frames] * vision.depth, gated=False, merge=vision.spatial_merge_size,
                      out_hidden=vision.out_hidden_size)
    unit = vision.spatial_merge_size ** 2
    merger = matmul(patches // unit, vision.hidden_size * unit, vision.hidden_size * unit) + \
        matmul(patches // unit, vision.hidden_size * unit, vision.out_hidden_size)
    return total + len(vision.deepstack_visual_indexes) * merger


def text_flops(config, seq: int, lm_head: bool = True) -> int:
    """The language model over ``seq`` tokens."""
    text = config.text_config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    sparse = sum(is_sparse_layer(text, i) for i in range(text.num_hidden_layers))
    dense = text.num_hidden_layers - sparse

    def layers(count: int, intermediate: int) -> int:
        return decoder_lm_flops(seq, text.hidden_size, count, text.num_attention_heads, text.num_key_value_heads,
                                intermediate, text.vocab_size, head_dim=head_dim, lm_head=False)

    total = layers(dense, text.intermediate_size) if dense else 0
    if sparse:
        experts = text.num_experts_per_tok * text.moe_intermediate_size  # k experts as one wide gated MLP
        total += layers(sparse, experts) + sparse * matmul(seq, text.hidden_size, text.num_experts)
    return total + (matmul(seq, text.hidden_size, text.vocab_size) if lm_head else 0)


def batch_flops(config, batch: dict) -> float:
    """Forward FLOPs per sample of a micro-batch of forward keywords."""
    return per_sample_flops(batch, lambda seq: text_flops(config, seq), lambda grids: vision_flops(config, grids))
