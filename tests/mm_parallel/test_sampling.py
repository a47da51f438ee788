"""Token choice (mm_parallel.sampling) against transformers' logits warpers, and its draws.

The filtered logits equal transformers' TemperatureLogitsWarper -> TopKLogitsWarper ->
TopPLogitsWarper chain (the order GenerationMixin builds) on random logits with ties; the
inverse-CDF draw on evenly spread uniforms reproduces the probabilities; each row's stream
depends only on its key."""

import numpy as np
import pytest
import torch  # noqa: F401  (the reference: required, see tests/conftest.py)

from mm_parallel.sampling import Sampling, row_uniforms

SETTINGS = [dict(temperature=0.7), dict(top_k=5), dict(top_p=0.8), dict(temperature=1.3, top_k=7, top_p=0.6),
            dict(top_k=1), dict(top_p=0.05), dict(temperature=0.5, top_p=0.95)]


def _logits():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (6, 40)).astype(np.float32)
    logits[1, 3:6] = logits[1].max()  # a three-way tie at the top
    logits[2, :20] = 0.25  # a tie at the top-k boundary
    return logits


def _transformers(logits, temperature=1.0, top_k=0, top_p=1.0):
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = torch.from_numpy(logits).double()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.numpy()


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "_".join(f"{k}{v}" for k, v in s.items()))
def test_filtered_logits_equal_transformers_warpers(settings):
    logits = _logits()
    ours = Sampling(do_sample=True, **settings).filtered_logits(logits)
    theirs = _transformers(logits, **settings)
    # which of 20 equal logits straddling the top-p cut survive is torch's sort order (not stable);
    # as many survive either way
    np.testing.assert_array_equal(np.isinf(ours).sum(-1), np.isinf(theirs).sum(-1))
    rows = [0, 1, 3, 4, 5] if settings.get("top_p", 1.0) < 1.0 else list(range(6))
    ours, theirs = ours[rows], theirs[rows]
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(theirs))
    kept = ~np.isinf(theirs)
    np.testing.assert_allclose(ours[kept], theirs[kept], rtol=1e-12)
    assert (kept.sum(-1) >= 1).all()


def test_evenly_spread_uniforms_draw_each_token_in_proportion():
    sampling = Sampling(do_sample=True, temperature=0.9, top_k=10, top_p=0.9)
    logits = _logits()[:1]
    probs = sampling.probabilities(logits)[0]
    n = 20000
    drawn = sampling.pick(np.repeat(logits, n, 0), (np.arange(n) + 0.5) / n)
    counts = np.bincount(drawn, minlength=logits.shape[1])
    assert np.abs(counts - probs * n).max() <= 1.0
    assert set(np.nonzero(counts)[0]) == set(np.nonzero(probs)[0])


def test_greedy_is_the_first_largest_logit():
    logits = _logits()
    np.testing.assert_array_equal(Sampling().pick(logits, np.zeros(6)), logits.argmax(-1))
    assert Sampling().pick(logits, np.zeros(6))[1] == 3


def test_a_rows_draws_depend_only_on_its_key():
    together = row_uniforms(7, [(0, 0), (4, 1), (4, 2)], 5)
    alone = row_uniforms(7, [(4, 1)], 5)
    np.testing.assert_array_equal(together[1], alone[0])
    assert not np.array_equal(together[1], together[2])
    assert not np.array_equal(row_uniforms(8, [(4, 1)], 5), alone)
    assert ((together >= 0) & (together < 1)).all()


@pytest.mark.parametrize("settings,message", [(dict(do_sample=True, temperature=0.0), "temperature"),
                                              (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p"),
                                              (dict(top_p=1.5), "top_p")])
def test_bad_settings_say_what_to_change(settings, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**settings)
