"""mm_data.balance: a global batch's samples given to data-parallel ranks, tokens and patches even."""

import itertools

import numpy as np
import pytest

from mm_data.balance import balance, max_over_mean, rank_loads


def _best_makespan(costs, ranks):
    """The optimum by enumeration (small instances): the lightest possible heaviest rank."""
    best = float("inf")
    for owners in itertools.product(range(ranks), repeat=len(costs)):
        loads = np.zeros(ranks)
        np.add.at(loads, np.array(owners), costs)
        best = min(best, loads.max())
    return best


@pytest.mark.parametrize("seed, ranks", [(0, 2), (1, 2), (2, 3), (3, 3), (4, 4)])
def test_one_kind_is_within_grahams_bound_of_the_optimum(seed, ranks):
    costs = np.random.default_rng(seed).integers(1, 100, 8).astype(float)
    assignment = balance(costs, ranks)
    assert sorted(i for samples in assignment for i in samples) == list(range(8))
    heaviest = rank_loads(costs, assignment).max()
    assert heaviest <= (4 / 3 - 1 / (3 * ranks)) * _best_makespan(costs, ranks) + 1e-9


def _long_tailed(count, seed=0):
    """Tokens lognormal around 563 (MindSpeed-MM's Qwen2.5-VL average), a third with an image."""
    rng = np.random.default_rng(seed)
    tokens = np.minimum(rng.lognormal(np.log(450), 0.7, count), 4096).round()
    patches = np.where(rng.random(count) < 1 / 3, rng.integers(256, 4096, count), 0)
    return [(t, p) for t, p in zip(tokens, patches)]


def test_tokens_and_patches_are_balanced_together():
    """64 samples on 4 ranks: both kinds within 3 % of the mean, where handing each rank a
    contiguous quarter of the batch (as a plain sampler does) leaves a rank 20 %+ over."""
    costs = _long_tailed(64)
    balanced = max_over_mean(costs, balance(costs, 4))
    contiguous = max_over_mean(costs, [list(range(r * 16, (r + 1) * 16)) for r in range(4)])
    assert max(balanced) <= 1.03, balanced
    assert max(contiguous) >= 1.2, contiguous
    assert balance(costs, 4) == balance(list(costs), 4)  # a pure function: every rank computes the same


def test_groups_stay_on_one_rank_and_a_missing_kind_is_harmless():
    costs = [(t, p, 0.0) for t, p in _long_tailed(24, seed=3)]  # no audio at all
    pairs = [[2 * i, 2 * i + 1] for i in range(12)]  # e.g. a preference pair's chosen and rejected answers
    assignment = balance(costs, 3, groups=pairs)
    owner = {i: r for r, samples in enumerate(assignment) for i in samples}
    assert all(owner[a] == owner[b] for a, b in pairs)
    assert all(samples == sorted(samples) for samples in assignment)
    assert max_over_mean(costs, assignment)[2] == 1.0


def test_equal_samples_spread_by_count():
    assert balance([5.0] * 6, 3) == [[0, 3], [1, 4], [2, 5]]


def test_bad_input_says_what_to_change():
    with pytest.raises(ValueError, match="at least as large as the data-parallel size"):
        balance([1.0, 2.0], 3)
    with pytest.raises(ValueError, match="exactly once"):
        balance([1.0, 2.0, 3.0], 2, groups=[[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="finite number >= 0"):
        balance([1.0, -2.0], 1)


def test_a_sampler_with_costs_gives_each_rank_its_balanced_share():
    """BucketBatchSampler(costs=...): the ranks' shares of every global batch are disjoint, cover
    it, are the same on every rank's sampler and even out tokens better than the contiguous cut; a
    bad sample costs nothing (the loader replaces it)."""
    from mm_data.errors import BadSample
    from mm_data.sampler import BucketBatchSampler

    rng = np.random.default_rng(3)
    tokens = np.minimum(rng.lognormal(np.log(450), 0.7, 64), 4096).astype(int)

    def costs(i):
        if i == 5:
            raise BadSample("broken.png", "unreadable")
        return tokens[i], 16 * (i % 3 == 0)

    samplers = [BucketBatchSampler(64, 16, r, 4, seed=1, costs=costs) for r in range(4)]
    plain = [BucketBatchSampler(64, 16, r, 4, seed=1) for r in range(4)]
    worst = {"balanced": [], "contiguous": []}
    for batch in samplers[0].epoch_batches(0):
        shares = [s.local(batch) for s in samplers]
        assert sorted(np.concatenate(shares).tolist()) == sorted(batch.tolist())
        position = {int(i): k for k, i in enumerate(batch)}
        batch_costs = [samplers[0].cost(int(i)) for i in batch]
        for name, cut in (("balanced", shares), ("contiguous", [p.local(batch) for p in plain])):
            worst[name].append(max(max_over_mean(batch_costs, [[position[int(i)] for i in s] for s in cut])))
    # the heaviest rank's worst kind (a few images over 4 ranks cannot be even): always lighter
    assert all(b < c for b, c in zip(worst["balanced"], worst["contiguous"])), worst
    assert samplers[0].cost(5) == (0.0, 0.0)


def test_a_token_budget_cuts_global_batches_by_tokens_and_positions_walk_the_epochs():
    """BucketBatchSampler(global_batch_tokens=...): the shuffled samples in order, as many as the
    budget holds (more only to give every rank one), whatever the data-parallel size; every epoch
    is cut anew, so `state_at` is the position the stream reaches after that many batches; a
    saved position of samples is refused by a sampler of tokens (and back)."""
    from mm_data import DataLoader
    from mm_data.sampler import BucketBatchSampler

    rng = np.random.default_rng(4)
    tokens = np.minimum(rng.lognormal(np.log(563), 0.8, 96), 4096).astype(int)
    budget = 4096
    one = BucketBatchSampler(96, None, seed=2, costs=lambda i: (tokens[i],), global_batch_tokens=budget)
    four = [BucketBatchSampler(96, None, r, 4, seed=2, costs=lambda i: (tokens[i],), global_batch_tokens=budget)
            for r in range(4)]
    for epoch in (0, 1):
        order = np.random.default_rng([2, epoch]).permutation(96)
        rank = {int(i): k for k, i in enumerate(order)}
        batches = sorted(one.epoch_batches(epoch), key=lambda b: rank[int(b[0])])  # cut in order, then shuffled
        taken = np.concatenate(batches)
        assert (taken == order[:len(taken)]).all()  # in the epoch's order, the rest under one budget left over
        assert tokens[order[len(taken):]].sum() < budget
        for batch, next_one in zip(batches, [b[0] for b in batches[1:]] + [None]):
            assert tokens[batch].sum() <= budget or len(batch) == 1
            if next_one is not None:  # full: the next sample would not have fit
                assert tokens[batch].sum() + tokens[next_one] > budget
        with_four = sorted(four[0].epoch_batches(epoch), key=lambda b: rank[int(b[0])])
        for batch, other in zip(batches, with_four):  # the same cut until a batch holds fewer than 4
            if len(batch) < 4:
                break
            assert (batch == other).all()
        assert all(len(b) >= 4 for b in with_four)
    walked = itertools.islice(one.positions(), 3 * len(one.epoch_batches(0)))
    for step, (epoch, position, _) in enumerate(walked):
        assert one.state_at(step) == {"epoch": epoch, "position": position, "seed": 2, "global_batch_size": None,
                                      "global_batch_tokens": budget}
    counted = BucketBatchSampler(96, 8, seed=2)
    with pytest.raises(ValueError, match="made with global_batch_size=8, this sampler has None"):
        DataLoader(list(range(96)), one).load_state_dict(counted.state_at(3))
    with pytest.raises(ValueError, match="made with global_batch_size=None, this sampler has 8"):
        DataLoader(list(range(96)), counted).load_state_dict(one.state_at(3))
    with pytest.raises(ValueError, match="exactly one"):
        BucketBatchSampler(96, 8, costs=lambda i: (tokens[i],), global_batch_tokens=budget)
    with pytest.raises(ValueError, match="needs costs"):
        BucketBatchSampler(96, None, global_batch_tokens=budget)
