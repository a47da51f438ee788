"""CogVideoX's image conditioning (I2V) and 1.5's frame padding, in numpy, as diffusers does them.

Latents here are (B, F, C, H, W), the transformer's layout.

    image latents   the first frame, noise-augmented for training as diffusers' CogVideoX I2V
                    training script does it (x + sigma eps, log sigma ~ N(-3, 0.5^2), one sigma per
                    sample, in pixel space before the VAE), encoded and scaled by the VAE's
                    scaling_factor — or divided by it when the VAE's invert_scale_latents is set
                    (CogVideoX 1.5 I2V: its pipeline does so, "the team forgot to multiply")
    condition       [image latents, zeros x (F - 1)] on frames, concatenated after the noisy latents
                    on channels (in_channels = 2 x latent channels); dropped to zeros with
                    probability noised_image_dropout in training (the script's 0.05)
    ofs             1.5 I2V's offset embedding gets 2.0, the pipeline's constant
    frame padding   1.5 cuts frames into patches of patch_size_t: F latent frames become F + F mod p_t
                    by repeating the first F mod p_t frames in front — the I2V pipeline pads its
                    image latents so, and its noise has as many frames (the leading ones are
                    dropped after sampling); training pads latents and condition alike
"""

from __future__ import annotations

from typing import Optional

import numpy as np

I2V_OFS = 2.0  # diffusers' CogVideoX 1.5 I2V pipeline: ofs_emb = full((1,), 2.0)


def noisy_first_frame(video: np.ndarray, rng: np.random.Generator, mean: float = -3.0,
                      std: float = 0.5) -> np.ndarray:
    """(B, C, 1, H, W): the first frame of pixel clips (B, C, F, H, W) plus sigma x N(0, 1),
    log sigma ~ N(mean, std^2) drawn per sample (diffusers' image noise augmentation)."""
    first = np.asarray(video[:, :, :1], np.float32)
    sigma = np.exp(rng.normal(mean, std, size=(len(first), 1, 1, 1, 1))).astype(np.float32)
    return first + rng.standard_normal(first.shape).astype(np.float32) * sigma


def image_latent_scale(vae_config: dict) -> float:
    """What multiplies the image's VAE latents: scaling_factor, or 1 / scaling_factor under
    invert_scale_latents (the 1.5 I2V checkpoints' VAE)."""
    scale = float(vae_config["scaling_factor"])
    return 1.0 / scale if vae_config.get("invert_scale_latents") else scale


def image_condition(image_latents: np.ndarray, frames: int) -> np.ndarray:
    """(B, frames, C, H, W): the image's latents (B, 1, C, H, W) on the first frame, zeros after."""
    image_latents = np.asarray(image_latents, np.float32)
    padding = np.zeros((image_latents.shape[0], frames - 1) + image_latents.shape[2:], np.float32)
    return np.concatenate([image_latents, padding], axis=1)


def patch_frames(frames: int, patch_size_t: Optional[int]) -> int:
    """The latent frames the transformer sees for ``frames``: F + F mod patch_size_t (module
    docstring), F for 1.0 (no patch_size_t)."""
    if not patch_size_t:
        return frames
    padded = frames + frames % patch_size_t
    if padded % patch_size_t:
        raise ValueError(f"{frames} latent frames do not fill patches of {patch_size_t} frames even after "
                         "the pipelines' padding: choose data.num_frames so that (num_frames - 1) / 4 + 1 divides")
    return padded


def pad_to_patch_frames(latents: np.ndarray, patch_size_t: Optional[int]) -> np.ndarray:
    """Latents (B, F, ...) with the first F mod patch_size_t frames repeated in front to
    `patch_frames` (module docstring); unchanged for 1.0 or when F divides."""
    extra = patch_frames(latents.shape[1], patch_size_t) - latents.shape[1]
    return np.concatenate([latents[:, :extra], latents], axis=1) if extra else latents
