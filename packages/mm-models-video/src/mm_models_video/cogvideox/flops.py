"""Forward FLOPs of the CogVideoX transformer (for MFU), from the config and the latents' shapes.

Only matrix products count (mm_profiling.flops' convention; a training step is 3 forwards): the
time (and ofs) embeddings, the text projection and the patch embedding, per block the two
modulations, q / k / v / out and the attention over the joint text + video rows and the 4x MLP,
the output modulation and projection of the video rows.
"""

from __future__ import annotations

from mm_profiling.flops import matmul


def cogvideox_flops(config, frames: int, height: int, width: int, text_len: int) -> int:
    """Forward FLOPs of one sample of latents (frames, height, width) with ``text_len`` text
    tokens; ``config``: a CogVideoXTransformerConfig."""
    p, p_t = config.patch_size, config.patch_size_t or 1
    tokens = frames // p_t * (height // p) * (width // p)
    dim, ted, heads = config.inner_dim, config.time_embed_dim, config.num_attention_heads
    rows = text_len + tokens
    total = matmul(1, dim, ted) + matmul(1, ted, ted)  # time embedding
    if config.ofs_embed_dim:
        total += 2 * matmul(1, config.ofs_embed_dim, config.ofs_embed_dim)
    total += matmul(text_len, config.text_embed_dim, dim)  # text projection
    total += matmul(tokens, config.in_channels * config.patch_volume, dim)  # patch embedding
    per_block = (2 * matmul(1, ted, 6 * dim)  # the two LayerNorm-zero modulations
                 + 4 * matmul(rows, dim, dim) + 2 * heads * matmul(rows, config.attention_head_dim, rows)
                 + 2 * matmul(rows, dim, 4 * dim))
    total += config.num_layers * per_block
    total += matmul(1, ted, 2 * dim) + matmul(tokens, dim, config.out_channels * config.patch_volume)
    return total


def batch_flops(config, batch: dict) -> float:
    """Forward FLOPs per sample of a micro-batch of forward keywords (all samples one shape)."""
    _, frames, _, height, width = batch["hidden_states"].shape
    return cogvideox_flops(config, frames, height, width, batch["encoder_hidden_states"].shape[1])
