"""DPO on a tiny Qwen2.5-VL: two pairs (one with a picture, one text-only) packed in one row, the
loss and every gradient of mm's model with `preference` (mm_parallel.preference.PairedBatch)
equal trl 1.16's DPO loss (its own code: tests/helpers/trl_dpo.py) on the log-probabilities the
transformers twin gives each sequence alone — sigmoid, ipo, and sigmoid with RPO's NLL; loss
rel 1e-5, gradients rel 1e-4."""

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
from helpers.trl_dpo import trl_dpo_loss

from mm_parallel.preference import PairedBatch, Settings


def _pairs(rng):
    """[(chosen, rejected)] one-sample inputs: a pair about a picture, a text-only pair."""
    grid = (1, 8, 12)
    media = {"pixel_values": rng.standard_normal((int(np.prod(grid)), 3 * 2 * 14 * 14)).astype(np.float32),
             "image_grid_thw": np.array([grid], np.int64)}
    text = lambda n: rng.integers(3, 240, n).tolist()  # noqa: E731
    picture = text(3) + placeholder(IMAGE, merged(grid)) + text(2)
    plain = text(6)
    return [(prompt_and_answer(picture, text(4), media), prompt_and_answer(picture, text(3), media)),
            (prompt_and_answer(plain, text(5)), prompt_and_answer(plain, text(2)))]


def _reference_token_log_probs(model, sequences, length):
    """(2P, length - 1) torch log-probs of each sequence's next tokens alone in transformers (0
    past its end), rows [chosen..., rejected...], and the (2P, length) answer-token mask."""
    rows, masks = [], []
    for inputs in sequences:
        out = model(**{k: torch.from_numpy(v) for k, v in inputs.items() if k != "labels"})
        labels = torch.from_numpy(inputs["labels"])[0, 1:]
        logps = torch.log_softmax(out.logits[0, :-1].float(), -1).gather(-1, labels.clamp(min=0)[:, None])[:, 0]
        rows.append(torch.nn.functional.pad(logps, (0, length - 1 - logps.shape[0])))
        mask = np.zeros(length, np.int64)
        mask[:inputs["labels"].shape[1]] = inputs["labels"][0] != -100
        masks.append(mask)
    return torch.stack(rows), torch.from_numpy(np.stack(masks))


@pytest.mark.parametrize("method, beta, sft_weight", [("sigmoid", 0.5, 0.0), ("ipo", 0.3, 0.0),
                                                      ("sigmoid", 0.2, 0.6)])
def test_dpo_on_a_packed_row_equals_trl_on_transformers(tmp_path, method, beta, sft_weight):
    import mm_models_vl

    reference = write_reference(tmp_path)
    ours = mm_models_vl.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path))
    rng = np.random.default_rng(4)
    pairs = _pairs(rng)
    reference_logps = rng.normal(-20.0, 2.0, (2, len(pairs))).astype(np.float32)  # (chosen, rejected) x pairs
    answer = lambda s: int((s["labels"] != -100).sum())  # noqa: E731

    # trl on transformers: rows [chosen..., rejected...]
    ordered = [c for c, _ in pairs] + [r for _, r in pairs]
    length = max(s["input_ids"].shape[1] for s in ordered)
    reference.zero_grad()
    token, mask = _reference_token_log_probs(reference, ordered, length)
    types, weights = ((method, "sft"), (1.0, sft_weight)) if sft_weight else ((method,), (1.0,))
    want = trl_dpo_loss(token, mask, torch.from_numpy(reference_logps[0]), torch.from_numpy(reference_logps[1]),
                        types, weights, beta)
    want.backward()
    want_grads = {n: p.grad.float().numpy() for n, p in reference.named_parameters() if p.grad is not None}

    # ours: one packed row, sequences [A chosen, A rejected, B chosen, B rejected]
    row = pack_samples([s for pair in pairs for s in pair])
    row["preference"] = PairedBatch(
        chosen=np.array([0, 2]), rejected=np.array([1, 3]), reference_chosen=reference_logps[0],
        reference_rejected=reference_logps[1], chosen_tokens=np.array([answer(c) for c, _ in pairs]),
        rejected_tokens=np.array([answer(r) for _, r in pairs]), pairs_in_batch=len(pairs),
        chosen_tokens_in_batch=sum(answer(c) for c, _ in pairs), settings=Settings(method, beta, 0.0, sft_weight))
    loss, _, grads = our_forward(ours, row)
    assert loss == pytest.approx(float(want.detach()), rel=1e-5)
    errors = {name: rel_err(grads[name], g) for name, g in want_grads.items()}
    assert max(errors.values()) <= 1e-4, sorted(errors.items(), key=lambda kv: -kv[1])[:5]


def test_a_pairs_media_go_through_the_tower_once_for_both_sequences(tmp_path):
    """A packed row of pairs as mm_data.vl.pairs lays it out (chosen segments, then rejected; the
    pixels once, a grid per placeholder run, media_copies 2) gives the loss and gradients of the
    same row with the pixels given again for the rejected sequences — with one tower call, not
    two (the tower's output feeds both placeholder runs, its gradient the sum of both)."""
    import types

    import mm_models_vl

    write_reference(tmp_path)
    ours = mm_models_vl.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path))
    rng = np.random.default_rng(5)
    pairs = _pairs(rng)
    chosen = [c for c, _ in pairs]
    rejected = [{k: v for k, v in r.items() if k != "pixel_values"} for _, r in pairs]
    twice = pack_samples(chosen + [r for _, r in pairs])
    once = {**pack_samples(chosen + rejected), "media_copies": 2}
    assert once["pixel_values"].shape[0] * 2 == twice["pixel_values"].shape[0]
    answer = lambda s: int((s["labels"] != -100).sum())  # noqa: E731
    preference = PairedBatch(
        chosen=np.array([0, 1]), rejected=np.array([2, 3]), reference_chosen=np.array([-20.0, -18.0], np.float32),
        reference_rejected=np.array([-19.0, -21.0], np.float32), chosen_tokens=np.array([answer(c) for c in chosen]),
        rejected_tokens=np.array([answer(r) for r in rejected]), pairs_in_batch=2.0, chosen_tokens_in_batch=9.0)
    patches, tower = [], ours.model.visual.construct

    def counted(self, pixels, grid):  # the patches the tower encodes
        patches.append(int(pixels.shape[0]))
        return tower(pixels, grid)

    object.__setattr__(ours.model.visual, "construct", types.MethodType(counted, ours.model.visual))
    results = [our_forward(ours, {**row, "preference": preference}) for row in (twice, once)]
    (loss_twice, logits_twice, grads_twice), (loss_once, logits_once, grads_once) = results
    picture = int(np.prod(pairs[0][0]["image_grid_thw"]))
    assert patches == [2 * picture, picture]  # the pair's picture encoded for each sequence, then once
    assert loss_once == pytest.approx(loss_twice, rel=1e-6)
    np.testing.assert_allclose(logits_once, logits_twice, rtol=1e-5, atol=1e-6)
    errors = {name: rel_err(grads_once[name], g) for name, g in grads_twice.items()}
    assert max(errors.values()) <= 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
