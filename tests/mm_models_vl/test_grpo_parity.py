"""GRPO on a tiny Qwen2.5-VL: two prompts (one with a picture, one text-only) with two completions
each, packed in one row; the loss and every gradient of mm's model with `preference`
(mm_parallel.grpo.PolicyBatch) equal trl 1.16's GRPO loss (its own code: tests/helpers/trl_grpo.py)
on the log-probabilities the transformers twin gives each sequence alone at the sampling
temperature — per token with the KL term and older log-probs, per completion on-policy with
clip-higher; loss rel 1e-5, gradients rel 1e-4."""

import numpy as np
import pytest
import torch
from helpers.packed_reference import pack_samples
from helpers.qwen_vl_reference import (
    IMAGE,
    merged,
    our_forward,
    placeholder,
    prompt_and_answer,
    rel_err,
    write_reference,
)
from helpers.trl_grpo import trl_grpo_loss

from mm_parallel.grpo import PolicyBatch, Settings, aggregation_weights, group_advantages

TEMPERATURE = 0.7


def _groups(rng):
    """Four one-sample inputs: two completions of a prompt about a picture, two of a text prompt."""
    grid = (1, 8, 12)
    media = {"pixel_values": rng.standard_normal((int(np.prod(grid)), 3 * 2 * 14 * 14)).astype(np.float32),
             "image_grid_thw": np.array([grid], np.int64)}
    text = lambda n: rng.integers(3, 240, n).tolist()  # noqa: E731
    picture, plain = text(3) + placeholder(IMAGE, merged(grid)) + text(2), text(6)
    return [prompt_and_answer(picture, text(4), media), prompt_and_answer(picture, text(2), media),
            prompt_and_answer(plain, text(5)), prompt_and_answer(plain, text(3))]


def _reference_completion_log_probs(model, sequences, width):
    """(B, width) torch log-probs of each completion's tokens (sequence alone, logits / T), and the mask."""
    rows, masks = [], []
    for inputs in sequences:
        out = model(**{k: torch.from_numpy(v) for k, v in inputs.items() if k != "labels"})
        labels = inputs["labels"][0]
        start = int(np.argmax(labels != -100))
        logits = out.logits[0, start - 1:-1].float() / TEMPERATURE
        tokens = torch.from_numpy(labels[start:])
        logps = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
        rows.append(torch.nn.functional.pad(logps, (0, width - logps.shape[0])))
        masks.append(np.arange(width) < logps.shape[0])
    return torch.stack(rows), torch.from_numpy(np.stack(masks).astype(np.float32))


def _at_targets(row, values, mask):
    """(1, length) per-target-position array of a packed row from (B, width) per-completion-token values."""
    targets = np.full_like(row["labels"], -100)
    targets[:, :-1] = row["labels"][:, 1:]
    positions = np.nonzero(targets[0] != -100)[0]
    out = np.zeros(row["labels"].shape, np.float32)
    out[0, positions] = np.asarray(values)[np.asarray(mask) > 0]
    return out


@pytest.mark.parametrize("aggregation, loss_type, beta, old, epsilon_high", [("token", "dapo", 0.05, True, None),
                                                                             ("sample", "grpo", 0.0, False, 0.28)])
def test_grpo_on_a_packed_row_equals_trl_on_transformers(tmp_path, aggregation, loss_type, beta, old, epsilon_high):
    import mm_models_vl

    reference = write_reference(tmp_path)
    ours = mm_models_vl.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path))
    rng = np.random.default_rng(6)
    sequences = _groups(rng)
    advantages = group_advantages(np.array([1.0, 0.2, 0.0, 0.5]), 2)
    width = max(int((s["labels"] != -100).sum()) for s in sequences)

    reference.zero_grad()
    token, mask = _reference_completion_log_probs(reference, sequences, width)
    old_logps = (token.detach() + torch.from_numpy(rng.normal(0, 0.2, token.shape).astype(np.float32))) * mask
    ref_logps = (token.detach() + torch.from_numpy(rng.normal(0, 0.3, token.shape).astype(np.float32))) * mask
    want, _ = trl_grpo_loss(token, mask, torch.from_numpy(advantages), old_logps if old else None,
                            ref_logps if beta else None, loss_type, 0.2, epsilon_high, beta)
    want.backward()
    want_grads = {n: p.grad.float().numpy() for n, p in reference.named_parameters() if p.grad is not None}

    row = pack_samples(sequences)
    per_token = np.broadcast_to(advantages[:, None], mask.shape)
    weights = aggregation_weights(mask.numpy(), aggregation, len(sequences), float(mask.sum()))
    row["preference"] = PolicyBatch(
        advantages=_at_targets(row, per_token, mask), weights=_at_targets(row, weights, mask),
        old_logps=_at_targets(row, old_logps, mask) if old else None,
        ref_logps=_at_targets(row, ref_logps, mask) if beta else None,
        settings=Settings(epsilon=0.2, epsilon_high=epsilon_high, beta=beta, temperature=TEMPERATURE))
    loss, _, grads = our_forward(ours, row)
    # a signed sum of O(0.1) terms (advantages of both signs) that cancels to O(1e-3): the log-probs'
    # float32 rounding (~1e-6 of values ~5) bounds it in absolute terms
    assert loss == pytest.approx(float(want.detach()), rel=1e-5, abs=1e-6)
    errors = {name: rel_err(grads[name], g) for name, g in want_grads.items()}
    assert max(errors.values()) <= 1e-4, sorted(errors.items(), key=lambda kv: -kv[1])[:5]
    assert any(name.startswith("model.visual.") for name in want_grads)
