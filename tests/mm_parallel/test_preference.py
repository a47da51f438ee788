"""mm_parallel.preference against trl's DPO loss (trl 1.16's own code, tests/helpers/trl_dpo.py):
the sequences' log-probs from per-token ones, the sigmoid, ipo and hinge losses, conservative
DPO's label smoothing (the mixture of the pair and its swap), RPO's added NLL — values and
gradients with respect to the token log-probs; the starting losses; bad settings refused."""

import math

import numpy as np
import pytest

P, L = 3, 7  # pairs, sequence length


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    token = rng.normal(-2.0, 0.7, (2 * P, L - 1)).astype(np.float32)
    mask = np.zeros((2 * P, L), np.int64)
    for row, start in enumerate(rng.integers(1, 4, 2 * P)):  # a prompt, then an answer of 2..5 tokens
        mask[row, start:start + int(rng.integers(2, L - start + 1))] = 1
    reference = rng.normal(-9.0, 1.5, 2 * P).astype(np.float32)
    return token, mask, reference


def _ours(token, mask, reference, method, beta, smoothing, sft_weight):
    """(loss, d loss / d token log-probs) through mm_parallel.preference."""
    import mindspore as ms
    from mindspore import Tensor

    from mm_parallel.preference import chosen_nll, preference_losses, sequence_log_probs

    targets = mask[:, 1:].astype(bool)  # position t predicts token t + 1
    index = np.where(targets, np.arange(2 * P)[:, None], -1)
    lengths = Tensor(targets.sum(1).astype(np.float32))

    def loss_of(token_log_probs):
        logps = sequence_log_probs(token_log_probs, index, 2 * P)
        ref = Tensor(reference)
        losses = preference_losses(logps[:P], logps[P:], ref[:P], ref[P:], method, beta, smoothing,
                                   lengths[:P], lengths[P:])
        loss = losses.mean()
        if sft_weight:
            loss = loss + sft_weight * chosen_nll(logps[:P], float(targets[:P].sum()))
        return loss

    loss, grad = ms.value_and_grad(loss_of)(Tensor(token))
    return float(loss.asnumpy()), grad.asnumpy()


def _trl(token, mask, reference, method, beta, smoothing, sft_weight):
    import torch
    from helpers.trl_dpo import trl_dpo_loss

    def loss_of(t, m, ref):
        types, weights = ((method, "sft"), (1.0, sft_weight)) if sft_weight else ((method,), (1.0,))
        return trl_dpo_loss(t, torch.tensor(m), torch.tensor(ref[:P]), torch.tensor(ref[P:]), types, weights, beta)

    t = torch.tensor(token, requires_grad=True)
    loss = loss_of(t, mask, reference)
    if smoothing:  # conservative DPO: each label flipped with probability e, i.e. the swapped pair's loss
        swap = np.r_[P:2 * P, 0:P]
        flipped = trl_dpo_loss(t[swap], torch.tensor(mask[swap]), torch.tensor(reference[P:]),
                               torch.tensor(reference[:P]), (method,), (1.0,), beta)
        loss = (1 - smoothing) * loss + smoothing * flipped
    loss.backward()
    return float(loss.detach()), t.grad.numpy()


@pytest.mark.parametrize("method, beta, smoothing, sft_weight", [
    ("sigmoid", 0.1, 0.0, 0.0), ("sigmoid", 0.5, 0.2, 0.0), ("sigmoid", 0.1, 0.0, 0.7),
    ("ipo", 0.3, 0.0, 0.0), ("hinge", 0.2, 0.0, 0.0)])
def test_losses_and_gradients_equal_trl(method, beta, smoothing, sft_weight):
    token, mask, reference = _inputs()
    ours, ours_grad = _ours(token, mask, reference, method, beta, smoothing, sft_weight)
    theirs, theirs_grad = _trl(token, mask, reference, method, beta, smoothing, sft_weight)
    assert ours == pytest.approx(theirs, rel=1e-5)
    np.testing.assert_allclose(ours_grad, theirs_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("method, beta, want", [("sigmoid", 0.1, math.log(2)), ("ipo", 0.25, 4.0),
                                                ("hinge", 0.1, 1.0)])
def test_the_loss_starts_where_the_policy_is_the_reference(method, beta, want):
    from mindspore import Tensor

    from mm_parallel.preference import preference_losses, starting_loss

    logps = Tensor(np.array([-3.0, -7.5], np.float32))
    losses = preference_losses(logps[:1], logps[1:], logps[:1], logps[1:], method, beta, 0.0,
                               Tensor(np.array([3.0], np.float32)), Tensor(np.array([5.0], np.float32)))
    assert float(losses.asnumpy()[0]) == pytest.approx(want, rel=1e-6) == starting_loss(method, beta)


def test_sequences_under_context_parallel_sum_their_ranks_parts(run_distributed):
    results = run_distributed(_cp_parts, nproc=2, timeout=120)
    assert results == [[], []], results


def _cp_parts():
    """Each cp rank holds half of every sequence's positions: the summed log-probs are the whole
    sequences' on both ranks, and each token's gradient is its sequence's."""
    import mindspore as ms
    from mindspore import Tensor

    import mm_parallel
    from mm_parallel import ParallelConfig
    from mm_parallel.preference import sequence_log_probs

    topo = mm_parallel.initialize(ParallelConfig(cp=2))
    token = np.arange(12, dtype=np.float32).reshape(2, 6) / 10
    index = np.array([[0, 0, 1, 1, 1, -1], [2, 2, 2, 3, 3, 3]])
    half = slice(3 * topo.cp.rank, 3 * topo.cp.rank + 3)
    weights = Tensor(np.array([1.0, 2.0, 3.0, 4.0], np.float32))
    out, grad = ms.value_and_grad(lambda t: (sequence_log_probs(t, index[:, half], 4, topo.cp) * weights).sum())(
        Tensor(token[:, half]))
    sums = [token[index == k].sum() for k in range(4)]
    problems = []
    if not np.allclose(float(out.asnumpy()), float(np.dot(sums, [1, 2, 3, 4])), rtol=1e-6):
        problems.append(f"weighted sum {out} != {np.dot(sums, [1, 2, 3, 4])}")
    want = np.where(index[:, half] >= 0, np.array([1.0, 2, 3, 4, 0])[index[:, half]], 0.0)
    if not np.allclose(grad.asnumpy(), want):
        problems.append(f"gradient {grad} != {want}")
    return problems


@pytest.mark.parametrize("settings, message", [
    (("dpo", 0.1, 0.0), "dpo.method='dpo' is unknown; use one of sigmoid, ipo, hinge"),
    (("sigmoid", 0.0, 0.0), "dpo.beta must be > 0"),
    (("sigmoid", 0.1, 0.5), r"dpo.label_smoothing must be in \[0, 0.5\)"),
    (("ipo", 0.1, 0.1), "dpo.label_smoothing applies to the sigmoid form only")])
def test_bad_settings_say_what_to_change(settings, message):
    from mm_parallel.preference import check_settings

    with pytest.raises(ValueError, match=message):
        check_settings(*settings)


def test_a_micro_batch_divides_by_its_share_of_the_global_batch():
    """PairedBatch's divisors are loss_share's D_r = pairs of the global batch / (micro-batches x
    dp), below one when a rank runs more micro-batches than it has pairs' share: not rounded up."""
    from mindspore import Tensor

    from mm_parallel.preference import PairedBatch, Settings, preference_losses

    logps = Tensor(np.array([-3.0, -4.0], np.float32))
    pairs = dict(chosen=np.array([0]), rejected=np.array([1]), reference_chosen=np.array([-3.5], np.float32),
                 reference_rejected=np.array([-3.5], np.float32), chosen_tokens=np.array([2]),
                 rejected_tokens=np.array([3]), chosen_tokens_in_batch=0.5, settings=Settings("sigmoid", 0.5, 0, 0.4))
    one = float(preference_losses(logps[:1], logps[1:], Tensor(np.array([-3.5], np.float32)),
                                  Tensor(np.array([-3.5], np.float32)), "sigmoid", 0.5).asnumpy()[0])
    got = float(PairedBatch(**pairs, pairs_in_batch=0.5).loss(logps).asnumpy())
    assert got == pytest.approx(one / 0.5 + 0.4 * 3.0 / 0.5, rel=1e-6)
