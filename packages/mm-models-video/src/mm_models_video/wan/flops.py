"""Forward FLOPs of the Wan DiT (2.1 and 2.2, for MFU) and of the Wan VAEs' encoder, from the
configs and the shapes alone.

Only matrix products count (mm_profiling.flops' convention; a training step is 3 forwards):
patch embedding, time and text (and I2V image) embedders, per block self-attention over the
video tokens, cross-attention to the text (and image) tokens and the FFN, the output projection.
"""

from __future__ import annotations

import numpy as np

from mm_profiling.flops import matmul


def _get(config, key, default=None):
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


def wan_dit_flops(config, frames: int, height: int, width: int, text_len: int, image_len: int = 0,
                  timesteps: float = 1) -> float:
    """Forward FLOPs of one sample on a latent of (frames, height, width). ``config``: diffusers'
    WanTransformer3DModel config (mapping or object); an I2V model (``image_dim`` set) attends to
    ``image_len`` image tokens through its added key / value projections; ``timesteps``: how many
    timesteps the sample embeds (one, or with per-token timesteps its share of the batch's
    distinct values: the model embeds each once)."""
    pt, ph, pw = _get(config, "patch_size")
    heads, head_dim = _get(config, "num_attention_heads"), _get(config, "attention_head_dim")
    dim, ffn = heads * head_dim, _get(config, "ffn_dim")
    tokens = (frames // pt) * (height // ph) * (width // pw)
    patch = pt * ph * pw
    total = matmul(tokens, _get(config, "in_channels") * patch, dim)  # patch embedding
    freq = _get(config, "freq_dim")
    total += timesteps * (matmul(1, freq, dim) + matmul(1, dim, dim) + matmul(1, dim, 6 * dim))  # time embedding
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
    samples, _, frames, height, width = batch["hidden_states"].shape
    image = batch.get("encoder_hidden_states_image")
    steps = np.asarray(batch["timestep"])
    timesteps = len(np.unique(steps)) / samples if steps.ndim == 2 else 1
    return wan_dit_flops(config, frames, height, width, batch["encoder_hidden_states"].shape[1],
                         0 if image is None else image.shape[1], timesteps)


def vae_encode_flops(vae_config: dict, frames: int, height: int, width: int) -> int:
    """FLOPs of AutoencoderKLWan.encode of one clip of ``frames`` (1 + 4k) x ``height`` x ``width``
    pixels, untiled (``vae_config``: its config.json fields; Wan2.1's or Wan2.2's layout).

    Convolutions count 2 x output elements x input channels x kernel volume; a causal
    convolution's output has its input's frames, so the chunking leaves the sum alone except at a
    temporal downsampler, whose stride-2 convolution skips the first chunk's lone frame: t frames
    become 1 + (t - 1) / 2, (t - 1) / 2 of them convolved. The per-frame attention of the mid block
    counts its q k^T and weights x v products."""
    from mm_models_video.wan.vae import AutoencoderKLWan

    cfg = {**AutoencoderKLWan.DEFAULTS, **vae_config}
    p = cfg["patch_size"] or 1
    shape = [frames, height // p, width // p]

    def conv(c_in, c_out, kernel_volume, out_shape=None):
        t, h, w = out_shape or shape
        return 2 * t * h * w * c_out * c_in * kernel_volume

    def resnet(c_in, c_out):
        return conv(c_in, c_out, 27) + conv(c_out, c_out, 27) + (conv(c_in, c_out, 1) if c_in != c_out else 0)

    def attention(c):
        t, h, w = shape
        return conv(c, 3 * c, 1) + conv(c, c, 1) + 2 * matmul(t * h * w, c, h * w)

    def downsample(c, temporal):
        t, h, w = shape
        shape[1:] = [(h - 2) // 2 + 1, (w - 2) // 2 + 1]  # zero row / column, 3 x 3 of stride 2
        total = conv(c, c, 9)
        if temporal and t > 1:
            total += conv(c, c, 3, [(t - 1) // 2] + shape[1:])
            shape[0] = 1 + (t - 1) // 2
        return total

    base, mult, blocks = cfg["base_dim"], list(cfg["dim_mult"]), cfg["num_res_blocks"]
    dims = [base * u for u in [1] + mult]
    total, scale, last = conv(cfg["in_channels"], dims[0], 27), 1.0, len(mult) - 1
    for i, (c_in, c_out) in enumerate(zip(dims[:-1], dims[1:])):
        for _ in range(blocks):
            total += resnet(c_in, c_out)
            if not cfg["is_residual"] and scale in cfg["attn_scales"]:
                total += attention(c_out)
            c_in = c_out
        if i != last:
            total += downsample(c_out, bool(cfg["temperal_downsample"][i]))
            scale /= 2.0
    total += 2 * resnet(dims[-1], dims[-1]) + attention(dims[-1])  # the mid block
    z2 = 2 * cfg["z_dim"]
    return total + conv(dims[-1], z2, 27) + conv(z2, z2, 1)  # conv_out, quant_conv
