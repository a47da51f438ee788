"""Tiny CogVideoX transformer configs (1.0 / 1.5, T2V / I2V, the 2B's sincos positions), weights
and inputs shared by the parity tests.

The reference is diffusers' CogVideoXTransformer3DModel on torch CPU (float32), its rotary tables
those of diffusers' CogVideoX pipeline (``_prepare_rotary_positional_embeddings``, the code users
run). Weights are drawn with a larger spread than diffusers' init, saved with the reference's own
save_pretrained and loaded into ours with from_pretrained.
"""

from __future__ import annotations

import numpy as np

TEXT = 7  # max_text_seq_length: with positions added the text must have this length
BASE = dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=24,
            text_embed_dim=20, num_layers=2, sample_width=8, sample_height=6, sample_frames=9, patch_size=2,
            max_text_seq_length=TEXT, use_rotary_positional_embeddings=True)
CONFIGS = {
    "1.0-t2v": dict(BASE),
    "1.0-i2v": dict(BASE, in_channels=8, use_learned_positional_embeddings=True),
    "1.0-2b": dict(BASE, use_rotary_positional_embeddings=False),
    "1.5-t2v": dict(BASE, patch_size_t=2, patch_bias=False),
    "1.5-i2v": dict(BASE, patch_size_t=2, patch_bias=False, in_channels=8, ofs_embed_dim=24),
}


def write_reference(path, kind: str, seed: int = 0):
    """A random diffusers model of ``kind`` saved to ``path``; returns it (torch, eval, float32)."""
    import torch
    from diffusers import CogVideoXTransformer3DModel as Reference

    torch.manual_seed(seed)
    model = Reference(**CONFIGS[kind]).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.ndim == 1 and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.6 / max(p[0].numel(), 1) ** 0.5 if p.ndim > 1 else 0.1))
        if model.patch_embed.use_learned_positional_embeddings:  # a trained table, not the sincos init
            model.patch_embed.pos_embedding.copy_(0.5 * torch.randn_like(model.patch_embed.pos_embedding))
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def pipeline_rotary(reference, frames: int, height: int, width: int):
    """diffusers' CogVideoX pipeline's rotary tables for latents frames x height x width (numpy)."""
    from diffusers import CogVideoXPipeline

    pipe = CogVideoXPipeline(tokenizer=None, text_encoder=None, vae=None, transformer=reference, scheduler=None)
    assert pipe.vae_scale_factor_spatial == 8  # without a VAE the pipeline assumes CogVideoX's 8
    cos, sin = pipe._prepare_rotary_positional_embeddings(8 * height, 8 * width, frames, "cpu")
    return cos.numpy(), sin.numpy()


def inputs(rng: np.random.Generator, kind: str, batch: int = 2, frames: int = 3, size=(6, 8), text_len: int = TEXT):
    """Forward keywords (numpy) and a target of one case, latents (B, F, C, H, W)."""
    config = CONFIGS[kind]
    out = {
        "hidden_states": rng.standard_normal((batch, frames, config["in_channels"]) + tuple(size)).astype(np.float32),
        "encoder_hidden_states": rng.standard_normal((batch, text_len, config["text_embed_dim"])).astype(np.float32),
        "timestep": rng.integers(0, 1000, batch).astype(np.int64),
        "target": rng.standard_normal((batch, frames, 4) + tuple(size)).astype(np.float32),
    }
    if config.get("ofs_embed_dim"):
        out["ofs"] = np.full((1,), 2.0, np.float32)  # what the 1.5 I2V pipeline passes
    return out


def reference_forward(model, batch: dict, rotary=None):
    """(loss, sample, {name: grad}) of the torch reference; loss = mean((sample - target)^2)."""
    import torch

    model.zero_grad()
    kwargs = {k: torch.from_numpy(np.asarray(v)) for k, v in batch.items() if k != "target"}
    if rotary is not None:
        kwargs["image_rotary_emb"] = tuple(torch.from_numpy(t) for t in rotary)
    sample = model(**kwargs).sample
    loss = ((sample - torch.from_numpy(batch["target"])) ** 2).mean()
    loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), sample.detach().numpy(), grads


def write_adapters(path, reference, r: int = 4, alpha: float = 8.0, seed: int = 0):
    """Random PEFT adapters for every LoRA target linear of the torch reference."""
    from helpers.torch_reference import write_peft_adapters

    from mm_models_video.cogvideox.parallel_plan import LORA_TARGETS

    write_peft_adapters(path, reference, LORA_TARGETS, r, alpha, seed)
