"""Tiny Wan2.1 DiT configs, weights and inputs shared by the parity and parallel tests.

The reference is diffusers' WanTransformer3DModel on torch CPU (float32). Weights are drawn here
with a larger spread than diffusers' init (so attention is far from uniform and every norm and
modulation matters), saved with the reference's own save_pretrained, and loaded into ours with
from_pretrained: the path users take with real checkpoints.
"""

from __future__ import annotations

import numpy as np
from helpers.torch_reference import write_peft_adapters

TEXT_LEN_I2V = 512  # diffusers' I2V attention assumes 512 text tokens (it splits the context there)


def tiny_config(i2v: bool = False, **overrides):
    """The DESIGN's tiny Wan: patch (1, 2, 2), 2 heads x 16, text_dim 32, freq_dim 32, ffn 64."""
    config = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                  out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True,
                  qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=64)
    config.update(overrides)
    if i2v:  # image latents + mask concatenated to the noise on channels; CLIP tokens of width 48,
        # projected to the model width, which the added k/v projections take
        inner = config["num_attention_heads"] * config["attention_head_dim"]
        config.update(in_channels=2 * 4 + 4, image_dim=48, added_kv_proj_dim=inner)
    return config


def write_reference(path, seed: int = 0, i2v: bool = False, **overrides):
    """A random diffusers model saved to ``path``; returns it (torch, eval mode, float32)."""
    import torch
    from diffusers import WanTransformer3DModel as Reference

    torch.manual_seed(seed)
    model = Reference(**tiny_config(i2v, **overrides)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.ndim == 1 and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "scale_shift_table" in name:
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.6 / max(p[0].numel(), 1) ** 0.5 if p.ndim > 1 else 0.1))
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def first_frame_timesteps(t: np.ndarray, frames: int, size, patch=(1, 2, 2)) -> np.ndarray:
    """(B, S) per-token timesteps as diffusers' pipelines build them with expand_timesteps (Wan2.2
    TI2V): each sample's t, 0 on the first latent frame's tokens (kept clean, the image)."""
    grid = (frames // patch[0], size[0] // patch[1], size[1] // patch[2])
    mask = np.ones(grid, np.float32)
    mask[0] = 0
    return (mask.reshape(1, -1) * np.asarray(t, np.float32).reshape(-1, 1)).astype(np.float32)


def inputs(rng: np.random.Generator, i2v: bool = False, batch: int = 2, frames: int = 3, size=(8, 8),
           text_len: int = 16, image_len: int = 5, token_timesteps: str = ""):
    """Forward keywords (numpy) and a velocity target of one case. ``token_timesteps``: "first_frame"
    (Wan2.2 TI2V's) or "random" (every token its own) for a (B, S) timestep."""
    channels = 12 if i2v else 4
    out = {
        "hidden_states": rng.standard_normal((batch, channels, frames) + tuple(size)).astype(np.float32),
        "timestep": rng.uniform(0, 1000, batch).astype(np.float32),
        "encoder_hidden_states": rng.standard_normal((batch, TEXT_LEN_I2V if i2v else text_len, 32)).astype(np.float32),
        "target": rng.standard_normal((batch, 4, frames) + tuple(size)).astype(np.float32),
    }
    if i2v:
        out["encoder_hidden_states_image"] = rng.standard_normal((batch, image_len, 48)).astype(np.float32)
    if token_timesteps == "first_frame":
        out["timestep"] = first_frame_timesteps(out["timestep"], frames, size)
    elif token_timesteps == "random":
        tokens = frames * (size[0] // 2) * (size[1] // 2)
        out["timestep"] = rng.uniform(0, 1000, (batch, tokens)).astype(np.float32)
    return out


def reference_forward(model, batch: dict, backward: bool = True):
    """(loss, sample, {name: grad}) of the torch reference; loss = mean((sample - target)^2)."""
    import torch

    model.zero_grad()
    kwargs = {k: torch.from_numpy(np.asarray(v)) for k, v in batch.items() if k != "target"}
    sample = model(**kwargs).sample
    loss = ((sample - torch.from_numpy(batch["target"])) ** 2).mean()
    grads = {}
    if backward:
        loss.backward()
        grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), sample.detach().numpy(), grads


def our_forward(model, batch: dict, backward: bool = True):
    """(loss, sample, {name: grad}) of ours, parameter names as diffusers'."""
    import mindspore as ms

    kept = {}

    def loss_fn():
        out = model(**batch)
        kept["sample"] = out.sample
        return out.loss

    names = {id(p): n for n, p in model.parameters_and_names()}
    params = model.trainable_params()
    if backward:
        loss, grads = ms.value_and_grad(loss_fn, None, params)()
        grads = {names[id(p)]: g.asnumpy() for p, g in zip(params, grads)}
    else:
        loss, grads = loss_fn(), {}
    return float(loss.asnumpy()), kept["sample"].asnumpy(), grads


def write_adapters(path, reference, r: int = 4, alpha: float = 8.0, seed: int = 0):
    """Random PEFT adapters for every LoRA target linear of the torch reference."""
    from mm_models_video.wan.parallel_plan import LORA_TARGETS

    write_peft_adapters(path, reference, LORA_TARGETS, r, alpha, seed)
