"""Forward FLOPs of the Wan2.1 DiT (for MFU), from the config and the latents' shapes alone.

Only matrix products count (mm_profiling.flops' convention; a training step is 3 forwards):
patch embedding, time and text (and I2V image) embedders, per block self-attention over the
video tokens, cross-attention to the text (and image) tokens and the FFN, the output projection.
"""

from __future__ import annotations

from mm_profiling.flops import matmul


def _get(config, key, default=None):
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def wan_dit_flops(config, frames: int, height: int, width: int, text_len: int, image_len: int = 0) -> int:
    """Forward FLOPs of one sample on a latent of (frames, height, width). ``config``: diffusers'
    WanTransformer3DModel config (mapping or object); an I2V model (``image_dim`` set) attends to
    ``image_len`` image tokens through its added key / value projections."""
    pt, ph, pw = _get(config, "patch_size")
    heads, head_dim = _get(config, "num_attention_heads"), _get(config, "attention_head_dim")
    dim, ffn = heads * head_dim, _get(config, "ffn_dim")
    tokens = (frames // pt) * (height // ph) * (width // pw)
    patch = pt * ph * pw
    total = matmul(tokens, _get(config, "in_channels") * patch, dim)  # patch embedding
    freq = _get(config, "freq_dim")
    total += matmul(1, freq, dim) + matmul(1, dim, dim) + matmul(1, dim, 6 * dim)  # time embedder + projection
    total += matmul(text_len, _get(config, "text_dim"), dim) + matmul(text_len, dim, dim)  # text embedder
    image_dim = _get(config, "image_dim")
    if image_dim and image_len:
        total += matmul(image_len, image_dim, image_dim) + matmul(image_len, image_dim, dim)  # image embedder
    per_block = (4 * matmul(tokens, dim, dim) + 2 * heads * matmul(tokens, head_dim, tokens)  # self-attention
                 + 2 * matmul(tokens, dim, dim) + 2 * matmul(text_len, dim, dim)  # cross: q, out; k, v on text
                 + 2 * heads * matmul(tokens, head_dim, text_len)
                 + 2 * matmul(tokens, dim, ffn))  # FFN
    if image_dim and image_len:  # I2V: added k / v on the image tokens, a second attention
        per_block += 2 * matmul(image_len, dim, dim) + 2 * heads * matmul(tokens, head_dim, image_len)
    total += _get(config, "num_layers") * per_block
    total += matmul(tokens, dim, _get(config, "out_channels") * patch)  # output projection
    return total


def batch_flops(config, batch: dict) -> float:
    """Forward FLOPs per sample of a micro-batch of forward keywords (all samples one shape)."""
    _, _, frames, height, width = batch["hidden_states"].shape
    image = batch.get("encoder_hidden_states_image")
    return wan_dit_flops(config, frames, height, width, batch["encoder_hidden_states"].shape[1],
                         0 if image is None else image.shape[1])
