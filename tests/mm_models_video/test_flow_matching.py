"""Flow matching equals diffusers: the training schedule, timestep densities, loss weightings, the
noisy input / velocity target, the model's weighted loss (as diffusers' training scripts compute
it) and the Euler sampler (FlowMatchEulerDiscreteScheduler.set_timesteps / step)."""

import math

import diffusers
import numpy as np
import pytest
import torch

from mm_models_video.flow_matching import FlowMatchingSchedule


@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0])
def test_training_schedule_and_points_equal_diffusers(shift):
    reference = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    ours = FlowMatchingSchedule(1000, shift)
    np.testing.assert_array_equal(ours.train_timesteps, reference.timesteps.numpy())
    np.testing.assert_array_equal(ours.train_sigmas, reference.sigmas.numpy())
    u = np.random.default_rng(0).random(64)
    timesteps, sigmas = ours.training_points(u)
    index = (torch.from_numpy(u) * 1000).long()  # the training scripts' indices
    np.testing.assert_array_equal(timesteps, reference.timesteps[index].numpy())
    np.testing.assert_array_equal(sigmas, reference.sigmas[index].numpy())


def test_densities_and_weightings_equal_diffusers_formulas():
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    ours = FlowMatchingSchedule(shift=3.0)
    raw = np.random.default_rng(1).random(32)
    u = torch.from_numpy(raw)
    expected = 1 - u - 1.29 * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)  # diffusers' "mode" on the same draws
    np.testing.assert_allclose(ours.draw_u(32, np.random.default_rng(1), "mode"), expected.numpy(), rtol=1e-12)
    normal = np.random.default_rng(2).normal(0.0, 1.0, 32)
    np.testing.assert_allclose(ours.draw_u(32, np.random.default_rng(2), "logit_normal"),
                               torch.sigmoid(torch.from_numpy(normal)).numpy(), rtol=1e-12)
    sigmas = ours.training_points(ours.draw_u(32, np.random.default_rng(3)))[1]
    for scheme in ("none", "sigma_sqrt", "cosmap"):
        np.testing.assert_allclose(ours.loss_weights(sigmas, scheme),
                                   compute_loss_weighting_for_sd3(scheme, torch.from_numpy(sigmas)).numpy(), rtol=1e-6)
    with pytest.raises(ValueError, match="unknown"):
        ours.loss_weights(sigmas, "sqrt")
    with pytest.raises(ValueError, match="unknown"):
        ours.draw_u(2, np.random.default_rng(0), "lognormal")


def test_weighted_model_loss_equals_the_training_script_loss(tmp_path):
    """loss = mean_b(w_b mean((pred_b - target_b)^2)), as diffusers' scripts reduce it."""
    from helpers.wan_reference import write_reference

    from mm_models_video import WanTransformer3DModel

    reference = write_reference(tmp_path)
    model = WanTransformer3DModel.from_pretrained(tmp_path)
    rng = np.random.default_rng(4)
    x0 = rng.standard_normal((2, 4, 3, 8, 8)).astype(np.float32)
    batch = FlowMatchingSchedule(shift=5.0).training_batch(x0, rng, density="logit_normal", weighting="cosmap")
    text = rng.standard_normal((2, 6, 32)).astype(np.float32)
    ours = float(model(encoder_hidden_states=text, **batch).loss.asnumpy())
    with torch.no_grad():
        pred = reference(hidden_states=torch.from_numpy(batch["hidden_states"]),
                         timestep=torch.from_numpy(batch["timestep"]),
                         encoder_hidden_states=torch.from_numpy(text)).sample
    target, weights = torch.from_numpy(batch["target"]), torch.from_numpy(batch["loss_weights"])
    expected = torch.mean((weights.view(-1, 1, 1, 1, 1) * (pred - target) ** 2).reshape(2, -1), 1).mean()
    assert abs(ours - expected.item()) <= 1e-5 * abs(expected.item())


def test_noisy_input_and_target():
    rng = np.random.default_rng(5)
    x0, noise = rng.standard_normal((3, 2, 4)).astype(np.float32), rng.standard_normal((3, 2, 4)).astype(np.float32)
    sigmas = np.array([0.1, 0.5, 1.0], np.float32)
    noisy, target = FlowMatchingSchedule.noisy_and_target(x0, noise, sigmas)
    s = torch.from_numpy(sigmas).view(-1, 1, 1)
    np.testing.assert_array_equal(noisy, ((1.0 - s) * torch.from_numpy(x0) + s * torch.from_numpy(noise)).numpy())
    np.testing.assert_array_equal(target, noise - x0)


@pytest.mark.parametrize("shift,steps", [(1.0, 4), (5.0, 10), (3.0, 1)])
def test_sampler_equals_scheduler_steps(shift, steps):
    reference = diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    reference.set_timesteps(steps)
    ours = FlowMatchingSchedule(1000, shift)
    timesteps, sigmas = ours.inference_sigmas(steps)
    np.testing.assert_allclose(timesteps, reference.timesteps.numpy(), rtol=1e-6)
    np.testing.assert_allclose(sigmas, reference.sigmas.numpy(), rtol=1e-6)

    weight = np.random.default_rng(6).standard_normal((4, 4)).astype(np.float32) * 0.3
    velocity = lambda x, t: np.tanh(x @ weight) * (t[:, None] / 1000.0)  # noqa: E731
    noise = np.random.default_rng(7).standard_normal((2, 4)).astype(np.float32)
    x = torch.from_numpy(noise)
    for t in reference.timesteps:
        v = torch.from_numpy(velocity(x.numpy(), np.full((2,), t.item(), np.float32)))
        x = reference.step(v, t, x).prev_sample
    np.testing.assert_allclose(ours.sample(velocity, noise, steps), x.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("boundary, published", [(875, 0.417), (900, 0.358)])
def test_expert_ranges_equal_mindspeed_mm_timestep_boundaries(boundary, published):
    """Wan2.2 A14B's experts split the shifted schedule (shift 5) where MindSpeed-MM's recipes do:
    examples/wan2.2/A14B/t2v/pretrain_model_{high,low}.json (boundary 0.875: max / min
    timestep boundary 0.417) and i2v (boundary 0.9: 0.358), its uniform index range."""
    from mm_models_video.flow_matching import FlowMatchingSchedule

    schedule = FlowMatchingSchedule(1000, 5.0)
    high, low = schedule.expert_u_ranges(boundary)
    assert high == (0.0, published) and low == (published, 1.0)
    t_high, _ = schedule.training_points(np.array([0.0, published - 1e-9]))
    t_low, _ = schedule.training_points(np.array([published, 1 - 1e-9]))
    assert t_high.min() >= boundary > t_low.max()


@pytest.mark.parametrize("density", ["uniform", "logit_normal", "mode"])
def test_draws_in_a_range_follow_the_density_conditioned_on_it(density):
    """draw_u_in against rejection sampling of the unrestricted density: every draw in range, the
    quantiles equal within sampling error, the range's mass its distribution function's."""
    from mm_models_video.flow_matching import FlowMatchingSchedule

    schedule = FlowMatchingSchedule(1000, 5.0)
    for u_range in schedule.expert_u_ranges(875):
        drawn = schedule.draw_u_in(100_000, np.random.default_rng(0), u_range, density)
        free = schedule.draw_u(1_000_000, np.random.default_rng(1), density)
        kept = free[(free >= u_range[0]) & (free < u_range[1])]
        assert drawn.min() >= u_range[0] and drawn.max() < u_range[1]
        np.testing.assert_allclose(np.quantile(drawn, [0.1, 0.5, 0.9]), np.quantile(kept, [0.1, 0.5, 0.9]), atol=4e-3)
        mass = np.diff(schedule.density_cdf(np.array(u_range), density))[0]
        assert abs(mass - len(kept) / len(free)) < 3e-3
