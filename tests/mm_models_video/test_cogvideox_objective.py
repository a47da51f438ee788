"""CogVideoX's schedule, training batch and samplers equal diffusers' CogVideoXDDIMScheduler /
CogVideoXDPMScheduler and the loss of its CogVideoX training scripts."""

import diffusers  # noqa: F401  (the reference: required, see tests/conftest.py)
import numpy as np
import pytest
import torch

from mm_models_video.cogvideox.objective import CogVideoXSchedule

# the 2B (snr_shift_scale 3) and 5B (1.0) checkpoints' scheduler_config.json, and other spacings
CONFIGS = {
    "2b": dict(snr_shift_scale=3.0),
    "5b": dict(snr_shift_scale=1.0),
    "leading": dict(timestep_spacing="leading", steps_offset=1, rescale_betas_zero_snr=False),
    "linspace": dict(timestep_spacing="linspace", set_alpha_to_one=False),
}
CHECKPOINT = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                  num_train_timesteps=1000, prediction_type="v_prediction", rescale_betas_zero_snr=True,
                  set_alpha_to_one=True, steps_offset=0, timestep_spacing="trailing")


def _pair(kind, cls=diffusers.CogVideoXDDIMScheduler):
    config = dict(CHECKPOINT, **CONFIGS[kind])
    return CogVideoXSchedule.from_config({"_class_name": cls.__name__, **config}), cls(**config)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_schedule_and_timesteps_equal_diffusers(kind):
    ours, theirs = _pair(kind)
    np.testing.assert_allclose(ours.alphas_cumprod, theirs.alphas_cumprod.numpy(), rtol=1e-12, atol=1e-15)
    assert ours.final_alpha_cumprod == pytest.approx(float(theirs.final_alpha_cumprod))
    for steps in (1, 4, 50, 333):
        theirs.set_timesteps(steps)
        np.testing.assert_array_equal(ours.timesteps(steps), theirs.timesteps.numpy())


def test_training_batch_is_the_scripts_objective():
    """noisy = add_noise, and mean((out - v)^2) equals the scripts' mean(w (get_velocity(out) - x0)^2)."""
    ours, theirs = _pair("5b")
    rng = np.random.default_rng(0)
    x0 = rng.standard_normal((3, 2, 4, 6, 6)).astype(np.float32)
    batch = ours.training_batch(x0, np.random.default_rng(1))
    again = np.random.default_rng(1)
    t = again.integers(0, 1000, 3)
    noise = again.standard_normal(x0.shape).astype(np.float32)
    tt = torch.from_numpy(t)
    noisy = theirs.add_noise(torch.from_numpy(x0), torch.from_numpy(noise), tt)
    np.testing.assert_allclose(batch["hidden_states"], noisy.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(batch["timestep"], t)
    out = rng.standard_normal(x0.shape).astype(np.float32)
    pred = theirs.get_velocity(torch.from_numpy(out), noisy, tt)  # the scripts' x0 prediction
    weights = (1 / (1 - theirs.alphas_cumprod[tt])).reshape(-1, 1, 1, 1, 1)
    script = torch.mean((weights * (pred - torch.from_numpy(x0)) ** 2).reshape(3, -1), dim=1).mean().item()
    ours_loss = float(np.mean((batch["loss_weights"][:, None] * ((out - batch["target"]) ** 2).reshape(3, -1))))
    assert ours_loss == pytest.approx(script, rel=1e-5)


def _model(x, t):
    """A stand-in for the transformer: deterministic, depends on x and t."""
    return np.tanh(0.7 * x + 0.3 * np.cos(x * 2.0)) * (1.0 + t.reshape((-1,) + (1,) * (x.ndim - 1)) / 1000.0)


@pytest.mark.parametrize("kind", ["2b", "5b", "leading"])
def test_ddim_sampling_equals_the_pipeline_loop(kind):
    ours, theirs = _pair(kind)
    noise = np.random.default_rng(2).standard_normal((2, 3, 4, 4, 4)).astype(np.float32)
    steps, scale = 6, 5.0
    uncond = lambda x, t: 0.5 * _model(x, t)  # noqa: E731
    for dynamic in (False, True):
        got = ours.sample(_model, noise, steps, "ddim", scale, uncond, dynamic)
        theirs.set_timesteps(steps)
        x = torch.from_numpy(noise)
        for t in theirs.timesteps:
            batch_t = np.full((2,), int(t), np.int64)
            c, u = (torch.from_numpy(f(x.numpy(), batch_t)) for f in (_model, uncond))
            g = 1 + scale * (1 - np.cos(np.pi * ((steps - t.item()) / steps) ** 5.0)) / 2 if dynamic else scale
            x = theirs.step(u + g * (c - u), t, x, return_dict=False)[0]
        np.testing.assert_allclose(got, x.numpy(), rtol=1e-5, atol=1e-5)


def test_dpm_steps_equal_diffusers_with_the_same_noise(monkeypatch):
    import diffusers.schedulers.scheduling_dpm_cogvideox as dpm

    ours, theirs = _pair("5b", diffusers.CogVideoXDPMScheduler)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 2, 4, 4, 4)).astype(np.float32)
    draws = [rng.standard_normal(x.shape).astype(np.float32) for _ in range(20)]
    given = iter(draws)
    monkeypatch.setattr(dpm, "randn_tensor", lambda shape, **kw: torch.from_numpy(next(given)))
    steps = 5
    theirs.set_timesteps(steps)
    timesteps = theirs.timesteps
    ref, ref_x0, got, got_x0, used = torch.from_numpy(x), None, x, None, 0
    for i, t in enumerate(timesteps):
        out = _model(got, np.full((2,), int(t)))
        back = timesteps[i - 1] if i else None
        ref, ref_x0 = theirs.step(torch.from_numpy(out), ref_x0, t, back, ref, return_dict=False)
        second = ref_x0 is not None and i > 0 and int(t) - 1000 // steps >= 0
        noises = (draws[used], draws[used + 1] if second else None)
        used += 2 if second else 1
        got, got_x0 = ours.dpm_step(out, got_x0, int(t), None if back is None else int(back), got, noises, steps)
        np.testing.assert_allclose(got, ref.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got_x0, ref_x0.numpy(), rtol=1e-5, atol=1e-5)


def test_bad_schedules_get_clear_errors():
    with pytest.raises(ValueError, match="uses 'scaled_linear'"):
        CogVideoXSchedule(beta_schedule="linear")
    with pytest.raises(ValueError, match="predicts v"):
        CogVideoXSchedule(prediction_type="epsilon")
    with pytest.raises(ValueError, match="not a CogVideoX one"):
        CogVideoXSchedule.from_config({"_class_name": "DDIMScheduler"})
    with pytest.raises(ValueError, match="num_steps must be between"):
        CogVideoXSchedule().timesteps(0)
    with pytest.raises(ValueError, match="stochastic: pass rng"):
        CogVideoXSchedule().sample(_model, np.zeros((1, 2)), 2, "dpm")
