"""CogVideoX's diffusion: v-prediction training and the DDIM / DPM samplers, in numpy.

Conventions are diffusers' (CogVideoXDDIMScheduler, CogVideoXDPMScheduler, the CogVideoX training
scripts), with a_t = alphas_cumprod[t]:

    betas      "scaled_linear" (every checkpoint's): linspace(sqrt(beta_start), sqrt(beta_end), T)^2, float64
    a_t        cumprod(1 - betas), then SNR-shifted a / (s + (1 - s) a) (snr_shift_scale s; the 2B
               checkpoints use 3, the 5B 1), then rescaled to zero terminal SNR
               (sqrt(a) shifted so sqrt(a_T) = 0 and scaled so sqrt(a_0) stays)
    training   t ~ U{0 .. T-1}, x_t = sqrt(a_t) x0 + sqrt(1 - a_t) eps, and the scripts' loss
               mean(w (sqrt(a_t) x_t - sqrt(1 - a_t) out - x0)^2), w = 1 / (1 - a_t), which is
               mean((out - v)^2) with v = sqrt(a_t) eps - sqrt(1 - a_t) x0 (the model's target;
               mm_models_video.cogvideox.modeling derives it)
    inference  timesteps by spacing ("trailing" in the checkpoints: round(T, T - T/N, ...) - 1);
               x0_pred = sqrt(a_t) x_t - sqrt(1 - a_t) out;
               DDIM (eta 0): x_prev = c x_t + (sqrt(a_prev) - sqrt(a_t) c) x0_pred,
                             c = sqrt((1 - a_prev) / (1 - a_t))
               DPM (diffusers' CogVideoX variant, stochastic): with lambda = log sqrt(a / (1 - a)),
                             h = lambda_prev - lambda, x_prev = m1 x_t - m2 D + m_n noise where
                             m1 = sqrt((1 - a_prev) / (1 - a_t)) e^-h, m2 = expm1(-2h) sqrt(a_prev),
                             m_n = sqrt(1 - a_prev) sqrt(1 - e^-2h), D = x0_pred on the first step,
                             else (1 + 1/2r) x0_pred - (1/2r) x0_pred_before, r = h_before / h
               classifier-free guidance out = out_u + g (out_c - out_u), g optionally dynamic:
                             1 + g (1 - cos(pi ((N - t) / N)^5)) / 2
Coefficients are float64 scalars applied to float32 latents, as in diffusers.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields
from typing import Callable, Optional, Tuple

import numpy as np

SPACINGS = ("linspace", "leading", "trailing")
SAMPLERS = ("ddim", "dpm")
SCHEDULER_CLASSES = ("CogVideoXDDIMScheduler", "CogVideoXDPMScheduler")


def _log_snr_root(a: float) -> float:
    """lambda = log sqrt(a / (1 - a)); -inf where a = 0 (the zero-terminal-SNR end), inf at a = 1
    (the final "alpha one"), as torch computes them."""
    if a <= 0:
        return -math.inf
    return math.log((a / (1 - a)) ** 0.5) if a < 1 else math.inf


@dataclass
class CogVideoXSchedule:
    """The schedule of a CogVideoX checkpoint's scheduler_config.json (defaults: the checkpoints')."""

    num_train_timesteps: int = 1000
    beta_start: float = 0.00085
    beta_end: float = 0.012
    beta_schedule: str = "scaled_linear"
    snr_shift_scale: float = 3.0
    rescale_betas_zero_snr: bool = True
    set_alpha_to_one: bool = True
    timestep_spacing: str = "trailing"
    steps_offset: int = 0
    prediction_type: str = "v_prediction"

    def __post_init__(self):
        if self.prediction_type != "v_prediction":
            raise ValueError(f"prediction_type={self.prediction_type!r}: CogVideoX predicts v ('v_prediction')")
        if self.timestep_spacing not in SPACINGS:
            raise ValueError(f"timestep_spacing {self.timestep_spacing!r} is unknown; use one of {SPACINGS}")
        n = self.num_train_timesteps
        if self.beta_schedule != "scaled_linear":
            raise ValueError(f"beta_schedule {self.beta_schedule!r}: every CogVideoX checkpoint uses 'scaled_linear'")
        betas = np.linspace(self.beta_start ** 0.5, self.beta_end ** 0.5, n, dtype=np.float64) ** 2
        a = np.cumprod(1.0 - betas)
        a = a / (self.snr_shift_scale + (1 - self.snr_shift_scale) * a)
        if self.rescale_betas_zero_snr:
            root = np.sqrt(a)
            first, last = root[0], root[-1]
            a = ((root - last) * (first / (first - last))) ** 2
        self.alphas_cumprod = a
        self.final_alpha_cumprod = 1.0 if self.set_alpha_to_one else float(a[0])

    @classmethod
    def from_config(cls, config) -> "CogVideoXSchedule":
        """From a scheduler_config.json (a diffusers folder's ``scheduler/``, the file) or a dict;
        keys of the diffusers schedulers that change nothing here (clip_sample ...) are ignored."""
        if not isinstance(config, dict):
            path = str(config)
            path = os.path.join(path, "scheduler_config.json") if os.path.isdir(path) else path
            with open(path) as f:
                config = json.load(f)
        if config.get("_class_name", SCHEDULER_CLASSES[0]) not in SCHEDULER_CLASSES:
            raise ValueError(f"scheduler {config['_class_name']} is not a CogVideoX one "
                             f"({', '.join(SCHEDULER_CLASSES)})")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names})

    # -- training ----------------------------------------------------------------------------

    def _coefficients(self, timesteps, ndim: int):
        """sqrt(a_t), sqrt(1 - a_t) in float32 shaped to broadcast over (B, ...) (diffusers casts
        alphas_cumprod to the latents' dtype first)."""
        a = self.alphas_cumprod.astype(np.float32)[np.asarray(timesteps, np.int64)]
        shape = (-1,) + (1,) * (ndim - 1)
        return np.sqrt(a).reshape(shape), np.sqrt(np.float32(1) - a).reshape(shape)

    def add_noise(self, x0: np.ndarray, noise: np.ndarray, timesteps) -> np.ndarray:
        root_a, root_b = self._coefficients(timesteps, x0.ndim)
        return (root_a * x0 + root_b * noise).astype(np.float32)

    def velocity(self, x0: np.ndarray, noise: np.ndarray, timesteps) -> np.ndarray:
        """v = sqrt(a_t) eps - sqrt(1 - a_t) x0 (diffusers' get_velocity(x0, eps, t))."""
        root_a, root_b = self._coefficients(timesteps, x0.ndim)
        return (root_a * noise - root_b * x0).astype(np.float32)

    def training_batch(self, x0: np.ndarray, rng: np.random.Generator) -> dict:
        """The model's ``hidden_states``, ``timestep``, ``target`` (v) and ``loss_weights`` (ones:
        the scripts' 1 / (1 - a_t) is folded into the target) for clean latents x0 (B, ...)."""
        timesteps = rng.integers(0, self.num_train_timesteps, x0.shape[0]).astype(np.int64)
        noise = rng.standard_normal(x0.shape).astype(np.float32)
        return {"hidden_states": self.add_noise(x0, noise, timesteps), "timestep": timesteps,
                "target": self.velocity(x0, noise, timesteps), "loss_weights": np.ones(x0.shape[0], np.float32)}

    # -- inference ---------------------------------------------------------------------------

    def timesteps(self, num_steps: int) -> np.ndarray:
        """diffusers' set_timesteps(num_steps) (int64, descending)."""
        n = self.num_train_timesteps
        if not 1 <= num_steps <= n:
            raise ValueError(f"num_steps must be between 1 and num_train_timesteps={n}, got {num_steps}")
        if self.timestep_spacing == "linspace":
            return np.linspace(0, n - 1, num_steps).round()[::-1].copy().astype(np.int64)
        if self.timestep_spacing == "leading":
            return (np.arange(0, num_steps) * (n // num_steps)).round()[::-1].astype(np.int64) + self.steps_offset
        return np.round(np.arange(n, 0, -n / num_steps)).astype(np.int64) - 1

    def _alpha(self, t: int) -> float:
        return float(self.alphas_cumprod[t]) if t >= 0 else self.final_alpha_cumprod

    def x0_prediction(self, out, x, t: int):
        a = self._alpha(t)
        return a ** 0.5 * x - (1 - a) ** 0.5 * out

    def ddim_step(self, out, x, t: int, num_steps: int):
        """(x_prev, x0_pred) of CogVideoXDDIMScheduler.step (eta 0)."""
        prev = t - self.num_train_timesteps // num_steps
        a, a_prev = self._alpha(t), self._alpha(prev)
        x0 = self.x0_prediction(out, x, t)
        c = ((1 - a_prev) / (1 - a)) ** 0.5
        return (c * x + (a_prev ** 0.5 - a ** 0.5 * c) * x0).astype(np.float32), x0

    def dpm_step(self, out, x0_before, t: int, t_before: Optional[int], x, noises: Tuple, num_steps: int):
        """(x_prev, x0_pred) of CogVideoXDPMScheduler.step; ``noises``: the one or two standard
        normal draws the step makes (the second for the second-order update)."""
        prev = t - self.num_train_timesteps // num_steps
        a, a_prev = self._alpha(t), self._alpha(prev)
        x0 = self.x0_prediction(out, x, t)
        lam, lam_prev = _log_snr_root(a), _log_snr_root(a_prev)  # -inf at the zero-SNR end, as in torch
        h = lam_prev - lam
        m1 = ((1 - a_prev) / (1 - a)) ** 0.5 * math.exp(-h)
        m2 = math.expm1(-2 * h) * a_prev ** 0.5
        m_noise = (1 - a_prev) ** 0.5 * (1 - math.exp(-2 * h)) ** 0.5
        first = (m1 * x - m2 * x0 + m_noise * noises[0]).astype(np.float32)
        if x0_before is None or prev < 0:
            return first, x0
        r = (lam - _log_snr_root(self._alpha(t_before))) / h
        denoised = (1 + 1 / (2 * r)) * x0 - (1 / (2 * r)) * x0_before
        return (m1 * x - m2 * denoised + m_noise * noises[1]).astype(np.float32), x0

    def sample(self, predict: Callable[[np.ndarray, np.ndarray], np.ndarray], noise: np.ndarray, num_steps: int,
               sampler: str = "ddim", guidance_scale: float = 1.0, unconditional: Optional[Callable] = None,
               use_dynamic_cfg: bool = False, rng: Optional[np.random.Generator] = None) -> np.ndarray:
        """The pipeline's denoising loop from ``noise``: ``predict(x, timesteps)`` gives the model's
        output (v); with ``unconditional`` and guidance, classifier-free guidance. DPM draws its
        noise from ``rng``."""
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler {sampler!r} is unknown; use one of {SAMPLERS}")
        if sampler == "dpm" and rng is None:
            raise ValueError("the DPM sampler is stochastic: pass rng")
        timesteps = self.timesteps(num_steps)
        x, x0 = np.asarray(noise, np.float32), None
        for i, t in enumerate(timesteps):
            batch_t = np.full((x.shape[0],), t, np.int64)
            out = np.asarray(predict(x, batch_t), np.float32)
            if unconditional is not None and guidance_scale != 1.0:
                scale = guidance_scale
                if use_dynamic_cfg:
                    scale = 1 + guidance_scale * (1 - math.cos(math.pi * ((num_steps - t) / num_steps) ** 5.0)) / 2
                out_u = np.asarray(unconditional(x, batch_t), np.float32)
                out = out_u + scale * (out - out_u)
            if sampler == "ddim":
                x, x0 = self.ddim_step(out, x, int(t), num_steps)
            else:
                draws = tuple(rng.standard_normal(x.shape).astype(np.float32) for _ in range(2))
                x, x0 = self.dpm_step(out, x0, int(t), int(timesteps[i - 1]) if i else None, x, draws, num_steps)
        return x
