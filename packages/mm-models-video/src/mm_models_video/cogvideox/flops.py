"""Forward FLOPs of the CogVideoX transformer (for MFU) and of its VAE's encoder (what online
encoding costs every step), from the configs and the shapes.

Only matrix products and convolutions count (mm_profiling.flops' convention; a training step is 3
forwards): the time (and ofs) embeddings, the text projection and the patch embedding, per block
the two modulations, q / k / v / out and the attention over the joint text + video rows and the
4x MLP, the output modulation and projection of the video rows. The VAE encoder's convolutions
(2 x output elements x input channels x kernel volume each) are counted chunk by chunk as diffusers
encodes (frames in batches of 8, the remainder in the first), through the frame-pair averaging of
its first log2(temporal_compression_ratio) down blocks and their stride-2 convolutions.
"""

from __future__ import annotations

import math

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


def _vae_chunk_flops(cfg: dict, frames: int, height: int, width: int) -> int:
    """Encoder FLOPs of one chunk of ``frames`` pixel frames (mm_models_video.cogvideox.vae's structure)."""
    def conv(c_in, c_out, kernel):  # a same-size (causal in time) convolution over the chunk's current shape
        return 2 * frames * height * width * c_out * c_in * kernel

    channels = cfg["block_out_channels"]
    total = conv(cfg["in_channels"], channels[0], 27)
    compressed_blocks = int(math.log2(cfg["temporal_compression_ratio"]))
    previous = channels[0]
    for i, out in enumerate(channels):
        for layer in range(cfg["layers_per_block"]):
            c_in = previous if layer == 0 else out
            total += conv(c_in, out, 27) + conv(out, out, 27) + (conv(c_in, out, 1) if c_in != out else 0)
        previous = out
        if i < len(channels) - 1:  # the downsampler: frame pairs averaged, then a 3 x 3 conv of stride 2
            if i < compressed_blocks and frames > 1:
                frames = 1 + (frames - 1) // 2 if frames % 2 else frames // 2
            height, width = (height - 2) // 2 + 1, (width - 2) // 2 + 1
            total += conv(out, out, 9)
    total += 2 * (conv(previous, previous, 27) + conv(previous, previous, 27))  # the mid block's two resnets
    return total + conv(previous, 2 * cfg["latent_channels"], 27)


def vae_encode_flops(vae_config: dict, frames: int, height: int, width: int) -> int:
    """FLOPs of AutoencoderKLCogVideoX.encode of one clip of ``frames`` x ``height`` x ``width``
    pixels (untiled; ``vae_config``: its config.json fields, defaults as the 5B's VAE)."""
    from mm_models_video.cogvideox.vae import DEFAULTS, ENCODE_FRAMES, frame_batches

    cfg = {**DEFAULTS, **vae_config}
    return sum(_vae_chunk_flops(cfg, min(end, frames) - start, height, width)
               for start, end in frame_batches(frames, ENCODE_FRAMES))
