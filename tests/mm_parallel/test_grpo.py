"""GRPO's objective (mm_parallel.grpo) against trl 1.16's GRPOTrainer on the same completions,
log-probabilities and advantages: loss and its gradient in the policy's log-probs (rel 1e-5) for
both aggregations (per token: trl's "dapo"; per completion: "grpo"), with and without the KL term,
the rollouts' own log-probs or older ones, symmetric and DAPO's clip-higher bounds; the
group-relative advantages against trl's formula on its own nanstd."""

import mindspore as ms
import numpy as np
import pytest
import torch
from helpers.trl_grpo import trl_grpo_loss

from mm_parallel.grpo import Settings, aggregation_weights, group_advantages, token_losses

CASES = {
    "token_on_policy": dict(aggregation="token", loss_type="dapo", old=False, beta=0.0),
    "sample_kl_clip_higher": dict(aggregation="sample", loss_type="grpo", old=True, beta=0.04, epsilon_high=0.28),
    "token_kl_old": dict(aggregation="token", loss_type="dapo", old=True, beta=0.1),
    "sample_on_policy": dict(aggregation="sample", loss_type="grpo", old=False, beta=0.0),
}


def _rollouts(seed=0, rows=6, tokens=5):
    rng = np.random.default_rng(seed)
    logps = rng.normal(-2.0, 0.8, (rows, tokens)).astype(np.float32)
    mask = (np.arange(tokens)[None] < rng.integers(1, tokens + 1, rows)[:, None]).astype(np.float32)
    old = (logps + rng.normal(0, 0.3, logps.shape)).astype(np.float32)  # some ratios outside 1 +- 0.2
    ref = (logps + rng.normal(0, 0.5, logps.shape)).astype(np.float32)
    advantages = group_advantages(rng.integers(0, 2, rows).astype(np.float32) + rng.random(rows), 3)
    return logps, mask, old, ref, advantages


@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_gradient_equal_trl(name):
    case = CASES[name]
    logps, mask, old, ref, advantages = _rollouts(list(CASES).index(name))
    settings = Settings(epsilon=0.2, epsilon_high=case.get("epsilon_high"), beta=case["beta"])

    policy = torch.from_numpy(logps).requires_grad_()
    want, _ = trl_grpo_loss(policy, torch.from_numpy(mask), torch.from_numpy(advantages),
                            torch.from_numpy(old) if case["old"] else None,
                            torch.from_numpy(ref) if case["beta"] else None, case["loss_type"], 0.2,
                            case.get("epsilon_high"), case["beta"])
    want.backward()

    weights = aggregation_weights(mask, case["aggregation"], len(mask), mask.sum())

    def loss(x):
        losses, _, _ = token_losses(x, ms.Tensor(old) if case["old"] else ms.ops.stop_gradient(x), ms.Tensor(ref),
                                    ms.Tensor(np.broadcast_to(advantages[:, None], mask.shape).copy()), settings)
        return (losses * ms.Tensor(weights)).sum()

    got, grad = ms.value_and_grad(loss)(ms.Tensor(logps))
    # on-policy, per completion, the advantages of a group cancel: the loss is 0 up to rounding
    assert float(got) == pytest.approx(float(want.detach()), rel=1e-5, abs=1e-7)
    np.testing.assert_allclose(grad.asnumpy(), policy.grad.numpy(), rtol=1e-5, atol=1e-7)
    assert np.abs(policy.grad.numpy()).max() > 0


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_follow_trls_formula(scale):
    from trl.trainer.utils import nanstd

    rewards = np.random.default_rng(1).random(12).astype(np.float32)
    r = torch.from_numpy(rewards)
    mean = r.view(-1, 4).mean(1).repeat_interleave(4)
    std = {"group": nanstd(r.view(-1, 4), dim=1).repeat_interleave(4), "batch": nanstd(r).expand_as(r)}.get(scale)
    want = (r - mean) / (std + 1e-4) if std is not None else r - mean
    np.testing.assert_allclose(group_advantages(rewards, 4, scale), want.numpy(), rtol=1e-5, atol=1e-6)


def test_unscored_completions_are_left_out_of_their_group_and_have_no_advantage():
    from trl.trainer.utils import nanstd

    rewards = np.array([1.0, np.nan, 0.0, 0.5, np.nan, np.nan, np.nan, 2.0], np.float32)
    r = torch.from_numpy(rewards).view(-1, 4)
    want = (r - torch.nanmean(r, 1, keepdim=True)) / (nanstd(r, dim=1, keepdim=True) + 1e-4)
    want = torch.nan_to_num(want, nan=0.0).view(-1).numpy()  # trl zeroes an unscorable completion's
    want[4:] = [0.0, 0.0, 0.0, 0.0]  # one scored completion in the group: std nan in trl, no advantage here
    np.testing.assert_allclose(group_advantages(rewards, 4), want, rtol=1e-5, atol=1e-6)


def test_a_parts_batch_std_from_summed_moments_is_the_whole_batchs():
    from mm_parallel.grpo import batch_moments, std_of_moments

    rewards = np.random.default_rng(2).random(12)
    summed = batch_moments(rewards[:6]) + batch_moments(rewards[6:])
    assert std_of_moments(summed) == pytest.approx(float(np.std(rewards, ddof=1)), rel=1e-9)
    np.testing.assert_allclose(group_advantages(rewards[:6], 3, "batch", std_of_moments(summed)),
                               group_advantages(rewards, 3, "batch")[:6], rtol=1e-6)


def test_a_group_with_equal_rewards_has_no_advantage_and_bad_groups_are_refused():
    advantages = group_advantages(np.array([1.0, 1.0, 0.0, 1.0]), 2)
    np.testing.assert_array_equal(advantages[:2], [0.0, 0.0])
    assert advantages[2] == -advantages[3] and advantages[3] > 0
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(np.ones(4), 3)
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(np.ones(4), 2, "rank")


@pytest.mark.parametrize("settings,message", [(dict(epsilon=0.0), "epsilon"), (dict(epsilon_high=-1.0), "epsilon_high"),
                                              (dict(beta=-0.1), "beta"), (dict(temperature=0.0), "temperature")])
def test_bad_settings_say_what_to_change(settings, message):
    with pytest.raises(ValueError, match=message):
        Settings(**settings)
