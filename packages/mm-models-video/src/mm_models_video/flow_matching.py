"""Flow matching (rectified flow) for the video DiTs: the training objective and an Euler sampler.

Conventions are diffusers' (FlowMatchEulerDiscreteScheduler and its training scripts), in numpy so
that data and trainer code can use them without a framework:

    x_sigma = (1 - sigma) x_0 + sigma noise          sigma in (0, 1], 1 = pure noise
    target  = noise - x_0                            the velocity the model predicts
    timestep = sigma * num_train_timesteps           what the model is conditioned on
    shift:  sigma -> shift sigma / (1 + (shift - 1) sigma)   (more time at high noise; Wan uses 3-5)
    loss    = mean_b( w(sigma_b) mean((pred_b - target_b)^2) )

Training draws u in [0, 1) per sample ("uniform", "logit_normal" or "mode" density), picks the
training schedule's entry int(u * num_train_timesteps), and weights the loss by "none", "sigma_sqrt"
or "cosmap" (diffusers' compute_density_for_timestep_sampling / compute_loss_weighting_for_sd3).
Restricted to a range of u (``u_range``: a Wan2.2 expert's timesteps, `expert_u_ranges`), u is
drawn from the density conditioned on the range, by the inverse of its distribution function
(for the uniform density MindSpeed-MM's uniform index in the expert's part of the schedule).
Sampling walks the inference schedule with x <- x + (sigma_next - sigma) v.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist
from typing import Callable, Optional, Tuple

import numpy as np

DENSITIES = ("uniform", "logit_normal", "mode")
WEIGHTINGS = ("none", "sigma_sqrt", "cosmap")


def shift_sigmas(sigmas, shift: float):
    """shift sigma / (1 + (shift - 1) sigma): the timestep shift of SD3 / Wan."""
    sigmas = np.asarray(sigmas, np.float32)
    return (shift * sigmas / (1 + (shift - 1) * sigmas)).astype(np.float32)


@dataclass
class FlowMatchingSchedule:
    """The training and inference schedules of diffusers' FlowMatchEulerDiscreteScheduler
    (static shift; no dynamic shifting, Karras or terminal stretching)."""

    num_train_timesteps: int = 1000
    shift: float = 1.0

    def __post_init__(self):
        if self.shift <= 0:
            raise ValueError(f"shift must be positive, got {self.shift}")
        steps = np.linspace(1, self.num_train_timesteps, self.num_train_timesteps, dtype=np.float32)[::-1]
        self.train_sigmas = shift_sigmas(steps / self.num_train_timesteps, self.shift)
        self.train_timesteps = (self.train_sigmas * self.num_train_timesteps).astype(np.float32)

    # -- training ----------------------------------------------------------------------------

    def draw_u(self, batch: int, rng: np.random.Generator, density: str = "uniform", logit_mean: float = 0.0,
               logit_std: float = 1.0, mode_scale: float = 1.29) -> np.ndarray:
        """u in [0, 1) per sample from the chosen density."""
        if density == "logit_normal":
            return 1.0 / (1.0 + np.exp(-rng.normal(logit_mean, logit_std, batch)))
        if density == "mode":
            u = rng.random(batch)
            return 1 - u - mode_scale * (np.cos(np.pi * u / 2) ** 2 - 1 + u)
        if density == "uniform":
            return rng.random(batch)
        raise ValueError(f"timestep density {density!r} is unknown; use one of {DENSITIES}")

    def expert_u_ranges(self, boundary: float) -> Tuple[Tuple[float, float], Tuple[float, float]]:
        """The u ranges of the high-noise expert's timesteps (t >= ``boundary``) and the low-noise
        one's (t < boundary): the training schedule runs from t = 1000 down, so its first entries."""
        split = int(np.count_nonzero(self.train_timesteps >= boundary)) / self.num_train_timesteps
        if not 0 < split < 1:
            raise ValueError(f"the boundary timestep {boundary:g} leaves one expert no training timestep")
        return (0.0, split), (split, 1.0)

    @staticmethod
    def density_cdf(u, density: str = "uniform", logit_mean: float = 0.0, logit_std: float = 1.0,
                    mode_scale: float = 1.29) -> np.ndarray:
        """P(U < u) under the density `draw_u` draws from."""
        u = np.clip(np.asarray(u, np.float64), 0.0, 1.0)
        if density == "uniform":
            return u
        if density == "logit_normal":
            with np.errstate(divide="ignore"):
                z = (np.log(u) - np.log1p(-u) - logit_mean) / logit_std
            return np.vectorize(lambda v: NormalDist().cdf(v) if np.isfinite(v) else float(v > 0))(z)
        if density == "mode":  # u = G(r) falls from 1 to 0 as r rises: P(U < u) = 1 - G^-1(u)
            return 1.0 - _invert_decreasing(lambda r: _mode_u(r, mode_scale), u)
        raise ValueError(f"timestep density {density!r} is unknown; use one of {DENSITIES}")

    @staticmethod
    def density_quantile(q, density: str = "uniform", logit_mean: float = 0.0, logit_std: float = 1.0,
                         mode_scale: float = 1.29) -> np.ndarray:
        """The u with P(U < u) = q (inverse of `density_cdf`)."""
        q = np.clip(np.asarray(q, np.float64), 1e-12, 1 - 1e-12)
        if density == "uniform":
            return q
        if density == "logit_normal":
            z = np.vectorize(NormalDist(logit_mean, logit_std).inv_cdf)(q)
            return 1.0 / (1.0 + np.exp(-z))
        if density == "mode":
            return _mode_u(1.0 - q, mode_scale)
        raise ValueError(f"timestep density {density!r} is unknown; use one of {DENSITIES}")

    def draw_u_in(self, batch: int, rng: np.random.Generator, u_range: Tuple[float, float], density: str = "uniform",
                  **density_args) -> np.ndarray:
        """u in [u_range) per sample from the density conditioned on the range."""
        low, high = (self.density_cdf(v, density, **density_args) for v in u_range)
        u = self.density_quantile(low + (high - low) * rng.random(batch), density, **density_args)
        return np.clip(u, u_range[0], np.nextafter(u_range[1], 0.0))

    def training_points(self, u) -> Tuple[np.ndarray, np.ndarray]:
        """(timesteps, sigmas) of the training schedule at int(u * num_train_timesteps)."""
        index = (np.asarray(u, np.float64) * self.num_train_timesteps).astype(np.int64)
        index = np.clip(index, 0, self.num_train_timesteps - 1)
        return self.train_timesteps[index], self.train_sigmas[index]

    @staticmethod
    def noisy_and_target(x0: np.ndarray, noise: np.ndarray, sigmas: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(x_sigma, velocity target) for clean latents x0 (B, ...) and per-sample sigmas (B,)."""
        s = np.asarray(sigmas, np.float32).reshape((-1,) + (1,) * (x0.ndim - 1))
        return ((1.0 - s) * x0 + s * noise).astype(np.float32), (noise - x0).astype(np.float32)

    @staticmethod
    def loss_weights(sigmas, weighting: str = "none") -> np.ndarray:
        """Per-sample loss weights w(sigma)."""
        sigmas = np.asarray(sigmas, np.float32)
        if weighting == "sigma_sqrt":
            return (sigmas ** -2.0).astype(np.float32)
        if weighting == "cosmap":
            return (2 / (np.pi * (1 - 2 * sigmas + 2 * sigmas ** 2))).astype(np.float32)
        if weighting == "none":
            return np.ones_like(sigmas)
        raise ValueError(f"loss weighting {weighting!r} is unknown; use one of {WEIGHTINGS}")

    def training_batch(self, x0: np.ndarray, rng: np.random.Generator, density: str = "uniform",
                       weighting: str = "none", u_range: Optional[Tuple[float, float]] = None, **density_args) -> dict:
        """Everything a train step needs beside the conditions: noisy latents, timesteps, target
        and loss weights (the model's ``hidden_states``, ``timestep``, ``target``, ``loss_weights``);
        ``u_range``: draw the timesteps within it (`draw_u_in`)."""
        noise = rng.standard_normal(x0.shape).astype(np.float32)
        u = self.draw_u(x0.shape[0], rng, density, **density_args) if u_range is None else \
            self.draw_u_in(x0.shape[0], rng, u_range, density, **density_args)
        timesteps, sigmas = self.training_points(u)
        noisy, target = self.noisy_and_target(x0, noise, sigmas)
        return {"hidden_states": noisy, "timestep": timesteps, "target": target,
                "loss_weights": self.loss_weights(sigmas, weighting)}

    # -- inference ---------------------------------------------------------------------------

    def inference_sigmas(self, num_steps: int) -> Tuple[np.ndarray, np.ndarray]:
        """(timesteps (N,), sigmas (N + 1,) ending at 0) as diffusers' set_timesteps(num_steps):
        evenly spaced between the training schedule's ends (already shifted), then shifted."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        n = self.num_train_timesteps
        timesteps = np.linspace(self.train_sigmas[0] * n, self.train_sigmas[-1] * n, num_steps)
        sigmas = shift_sigmas((timesteps / n).astype(np.float32), self.shift)
        return (sigmas * n).astype(np.float32), np.concatenate([sigmas, np.zeros(1, np.float32)])

    def sample(self, velocity: Callable[[np.ndarray, np.ndarray], np.ndarray], noise: np.ndarray, num_steps: int,
               guidance_scale: float = 1.0, unconditional: Optional[Callable] = None) -> np.ndarray:
        """Euler integration from ``noise`` (sigma = 1) to sigma = 0. ``velocity(x, timesteps)``
        predicts v; with ``unconditional`` and guidance_scale != 1, classifier-free guidance
        v = v_u + g (v_c - v_u)."""
        timesteps, sigmas = self.inference_sigmas(num_steps)
        x = np.asarray(noise, np.float32)
        for i, t in enumerate(timesteps):
            t_batch = np.full((x.shape[0],), t, np.float32)
            v = np.asarray(velocity(x, t_batch), np.float32)
            if unconditional is not None and guidance_scale != 1.0:
                v_u = np.asarray(unconditional(x, t_batch), np.float32)
                v = v_u + guidance_scale * (v - v_u)
            x = (x + (sigmas[i + 1] - sigmas[i]) * v).astype(np.float32)
        return x


def _mode_u(r, scale: float):
    """The "mode" density's u of a uniform r (diffusers' compute_density_for_timestep_sampling)."""
    return 1 - r - scale * (np.cos(np.pi * r / 2) ** 2 - 1 + r)


def _invert_decreasing(fn, values, iterations: int = 60) -> np.ndarray:
    """r in [0, 1] with fn(r) = value for a decreasing fn, by bisection (elementwise)."""
    low, high = np.zeros_like(values), np.ones_like(values)
    for _ in range(iterations):
        middle = (low + high) / 2
        above = fn(middle) > values
        low, high = np.where(above, middle, low), np.where(above, high, middle)
    return (low + high) / 2
