"""Forward FLOPs of Qwen2.5-VL (for MFU), from the config and the inputs' shapes alone.

Only matrix products count (mm_profiling.flops' convention; a training step is 3 forwards). The
language model is a decoder over each sample's real tokens; the vision tower a ViT over the
packed patches of every image / video, its attention segments being the windows of the model's
own window index (`positions.window_index`) and, in ``fullatt_block_indexes``, whole frames.
"""

from __future__ import annotations

import numpy as np

from mm_models_vl.qwen2_5_vl import positions as pos
from mm_profiling.flops import decoder_lm_flops, vit_flops


def vision_flops(config, grids) -> int:
    """The vision tower (patch embedding, blocks, merger) over the patches of ``grids`` (n, 3)."""
    vision = config.vision_config
    grids = np.asarray(grids, np.int64).reshape(-1, 3)
    if not len(grids):
        return 0
    _, bounds = pos.window_index(grids, vision.spatial_merge_size, vision.window_size, vision.patch_size)
    windows, frames = np.diff(bounds).tolist(), np.diff(pos.frame_cu_seqlens(grids)).tolist()
    per_block = [frames if i in set(vision.fullatt_block_indexes) else windows for i in range(vision.depth)]
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    return vit_flops(int(np.prod(grids, axis=1).sum()), patch_dim, vision.hidden_size, vision.num_heads,
                     vision.intermediate_size, per_block, merge=vision.spatial_merge_size,
                     out_hidden=vision.out_hidden_size)


def qwen2_5_vl_flops(config, seq: int, image_grid_thw=None, video_grid_thw=None, lm_head: bool = True) -> int:
    """Forward FLOPs of one sample: ``seq`` tokens, its images' and videos' grids."""
    text = config.text_config
    total = decoder_lm_flops(seq, text.hidden_size, text.num_hidden_layers, text.num_attention_heads,
                             text.num_key_value_heads, text.intermediate_size, text.vocab_size, lm_head=lm_head)
    for grids in (image_grid_thw, video_grid_thw):
        if grids is not None:
            total += vision_flops(config, grids)
    return total


def batch_flops(config, batch: dict) -> float:
    """Forward FLOPs per sample of a micro-batch of forward keywords."""
    return per_sample_flops(batch, lambda seq: qwen2_5_vl_flops(config, seq),
                            lambda grids: vision_flops(config, grids))


def sample_lengths(batch: dict) -> np.ndarray:
    """Each sample's real length in a micro-batch of forward keywords: the attention mask's count
    per row where one is given; a packed row's samples are the runs its attention_mask numbers."""
    ids = np.asarray(batch["input_ids"])
    mask = batch.get("attention_mask")
    if mask is None:
        return np.full(len(ids), ids.shape[1])
    mask = np.asarray(mask)
    if mask.size and mask.max() > 1:  # a packed row
        lengths = np.bincount(mask.reshape(-1).astype(np.int64))[1:]
        return lengths[lengths > 0]
    return mask.sum(1)


def per_sample_flops(batch: dict, text_flops, vision_flops) -> float:
    """(text_flops(seq) over each sample's real length (`sample_lengths`: attention stays inside
    a packed row's samples) plus vision_flops(grids) of the images and the videos) / samples."""
    lengths = sample_lengths(batch)
    text = sum(text_flops(int(n)) for n in lengths)
    vision = sum(vision_flops(batch[key]) for key in ("image_grid_thw", "video_grid_thw") if batch.get(key) is not None)
    return (text + vision) / len(lengths)
