"""Batched decoding against transformers' generate: left-padded batches, step logits, token agreement.

transformers' greedy search and ours agree token for token while each row's top-2 logit gap is
above the two implementations' rounding; a row whose gap falls below ``gap`` may take either
token, and from there on the row is not compared (its continuations differ legitimately).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mm_parallel.sampling import Sampling


@dataclass(frozen=True)
class RecordingSampling(Sampling):
    """Greedy choice that keeps the logits each step chose from (rows, vocab)."""

    seen: list = field(default_factory=list)

    def pick(self, logits, uniforms):
        self.seen.append(np.array(logits))
        return super().pick(logits, uniforms)


def reference_greedy(reference, inputs: dict, steps: int):
    """transformers' greedy generate on numpy ``inputs``: (new tokens (rows, n), [step logits (rows, vocab)])."""
    import torch

    kwargs = {k: (torch.from_numpy(np.asarray(v)) if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
    with torch.no_grad():
        out = reference.generate(**kwargs, max_new_tokens=steps, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
    prompt = inputs["input_ids"].shape[1]
    return out.sequences[:, prompt:].numpy(), [step.float().numpy() for step in out.logits]


def assert_decodes_like_reference(reference, ours, inputs: dict, steps: int, rel: float = 1e-5,
                                  gap: float = 1e-4) -> int:
    """Our batched greedy decoding of ``inputs`` (left-padded, no labels) against transformers':
    each step's logits within ``rel`` (relative to the step's largest logit) on the rows still in
    step, the tokens equal while the row's top-2 gap exceeds ``gap``. Returns the tokens compared."""
    from mm_parallel.decoding import decode

    expected, expected_logits = reference_greedy(reference, inputs, steps)
    generation = reference.generation_config
    eos = np.atleast_1d(generation.eos_token_id).tolist()
    pad = generation.pad_token_id if generation.pad_token_id is not None else eos[0]
    recording = RecordingSampling()
    got = decode([ours], inputs, steps, recording, stop_tokens=eos, pad_id=pad).tokens
    live, compared = np.ones(len(expected), bool), 0
    for step, (theirs, mine) in enumerate(zip(expected_logits, recording.seen)):
        scale = np.abs(theirs[live]).max()
        err = np.abs(mine[live] - theirs[live]).max() / scale
        assert err <= rel, f"step {step}: logits rel-err {err:.2e} > {rel}"
        top2 = np.sort(theirs, -1)[:, -2:]
        sure = live & (top2[:, 1] - top2[:, 0] > gap)
        np.testing.assert_array_equal(got[sure, step], expected[sure, step], err_msg=f"step {step}")
        compared += int(sure.sum())
        live = sure & ~np.isin(expected[:, step], eos)
    assert compared >= len(expected) * min(steps, len(expected_logits)) // 2, \
        f"only {compared} tokens had a top-2 gap above {gap}: the comparison says little"
    return compared
