"""Packed rows (several samples in one row, attention_mask numbering them) equal the samples run
one by one in transformers, for Qwen2.5-VL, Qwen3-VL and the Qwen2.5-Omni thinker: the per-token
loss (num_items_in_batch = every sample's answer tokens) and the mean of per-sample means
(loss_per_sample), loss rel 1e-5 and every gradient rel 1e-4; and the host rules of
`mm_models_vl.qwen2_5_vl.packed_rows`."""

import numpy as np
import pytest
import torch  # noqa: F401  (the parity reference: required, see tests/conftest.py)
from helpers import omni_reference, qwen3_vl_reference, qwen_vl_reference
from helpers.packed_reference import counted, pack_samples, reference_of_samples
from helpers.qwen_vl_reference import our_forward, rel_err

FAMILIES = {  # name: (reference helpers, our class, the samples packed into one row)
    "qwen2_5_vl": (qwen_vl_reference, "Qwen2_5_VLForConditionalGeneration", ["image", "text", "video", "image_video"]),
    "qwen3_vl": (qwen3_vl_reference, "Qwen3VLForConditionalGeneration", ["video", "image", "text"]),
    "qwen2_5_omni": (omni_reference, "Qwen2_5OmniThinkerForConditionalGeneration", ["audio", "image", "text", "video"]),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    import mm_models_vl

    helpers, ours, cases = FAMILIES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    reference = helpers.write_reference(path)
    rng = np.random.default_rng(7)
    samples = [helpers.sample(case, rng) for case in cases]
    for s in samples:  # one-sample inputs: the mask is implied (the packed row numbers the samples)
        s.pop("attention_mask", None) if request.param != "qwen2_5_omni" else None
    return reference, getattr(mm_models_vl, ours).from_pretrained(path), samples


@pytest.mark.parametrize("per_sample", [False, True], ids=["token", "sample"])
def test_a_packed_row_equals_its_samples_in_transformers(family, per_sample):
    reference, ours, samples = family
    expected_loss, expected_grads = reference_of_samples(reference, samples, per_sample)
    row = pack_samples(samples)
    assert row["attention_mask"].max() == len(samples)
    row["num_items_in_batch"] = len(samples) if per_sample else sum(counted(s) for s in samples)
    row["loss_per_sample"] = per_sample
    loss, _, grads = our_forward(ours, row)
    assert abs(loss - expected_loss) <= 1e-5 * abs(expected_loss)
    errors = {name: rel_err(grads[name], g) for name, g in expected_grads.items()}
    assert max(errors.values()) <= 1e-4, sorted(errors.items(), key=lambda kv: -kv[1])[:5]


def test_packed_row_rules():
    from mm_models_vl.qwen2_5_vl import packed_rows

    assert packed_rows.row_segments(np.ones((2, 5))) is None  # a 0 / 1 mask: not packed
    segments = packed_rows.row_segments(np.array([[1, 1, 2, 2, 2, 3, 0, 0]]))
    np.testing.assert_array_equal(segments, [[1, 1, 2, 2, 2, 3, 0, 0]])
    targets = np.array([[5, 6, 7, 8, 9, 10, -100, -100]])
    np.testing.assert_array_equal(packed_rows.cut_at_boundaries(targets, segments),
                                  [[5, -100, 7, 8, -100, -100, -100, -100]])
    weights, samples = packed_rows.sample_weights(np.array([[5, -100, 7, 8, -100, 4]]), np.array([[1, 1, 2, 2, 2, 3]]))
    np.testing.assert_allclose(weights, [[1, 0, 0.5, 0.5, 0, 1]])
    assert samples == 3
    with pytest.raises(ValueError, match="one per micro-batch"):
        packed_rows.row_segments(np.array([[1, 2], [1, 2]]))
    with pytest.raises(ValueError, match="in order"):
        packed_rows.row_segments(np.array([[1, 2, 1]]))


def test_each_packed_sample_has_its_transformers_sequence_log_prob(family):
    """The preference objectives' input (Qwen2_5_VLForConditionalGeneration.sequence_log_probs,
    which Qwen3-VL and the Omni thinker inherit): each sample of a packed row gets the summed
    log-probabilities of its answer tokens that transformers gives the sample alone (rel 1e-5)."""
    from mindspore import Tensor

    reference, ours, samples = family
    want = []
    with torch.no_grad():
        for s in samples:
            logits = reference(**{k: torch.from_numpy(np.asarray(v)) for k, v in s.items()}).logits.float()
            labels = torch.from_numpy(np.asarray(s["labels"]))[:, 1:]
            logps = torch.log_softmax(logits[:, :-1], -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
            want.append(float((logps * (labels != -100)).sum()))
    row = pack_samples(samples)
    _, logits, _ = our_forward(ours, row, backward=False)
    plan = ours.sequence_plan(**ours.plan_args(row))
    got = ours.sequence_log_probs(Tensor(logits), plan).asnumpy()
    assert plan.sequence_count == len(samples)
    np.testing.assert_allclose(got, want, rtol=1e-5)
