"""Batched, left-padded decoding with the key/value cache (mm_parallel.decoding) equals
transformers' generate for every VL family: Qwen2.5-VL, Qwen3-VL dense and MoE, the Qwen2.5-Omni
thinker, on batches whose rows hold different pictures / audio (a row's media encoded once, its
M-RoPE positions continued per row): each step's logits within rel 1e-5, tokens equal wherever
the top-2 gap exceeds 1e-4 (tests/helpers/decoding_reference.py)."""

import numpy as np
import pytest
import torch  # noqa: F401  (the parity reference: required, see tests/conftest.py)
from helpers import omni_reference, qwen3_vl_reference, qwen_vl_reference
from helpers.decoding_reference import assert_decodes_like_reference

from mm_data.vl import left_padded

STEPS = 10


def _prompts(case: str):
    rng = np.random.default_rng(3)
    module = {"qwen2_5_vl": qwen_vl_reference, "omni": omni_reference}.get(case, qwen3_vl_reference)
    inputs = left_padded(module.padded_pair(rng))  # each row's pads moved to its front
    inputs.pop("labels")
    return inputs


def _models(case: str, path):
    import mm_models_vl

    if case == "qwen2_5_vl":
        reference = qwen_vl_reference.write_reference(path)
        return reference, mm_models_vl.Qwen2_5_VLForConditionalGeneration.from_pretrained(path)
    if case == "omni":
        reference = omni_reference.write_reference(path)
        return reference, mm_models_vl.Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(path)
    moe = case == "qwen3_vl_moe"
    reference = qwen3_vl_reference.write_reference(path, moe=moe)
    # transformers 5.24's load-balancing loss fails on a padded batch's incremental steps (its mask
    # covers the cache, the router logits one token); generation does not use it
    reference.config.text_config.output_router_logits = False
    ours = mm_models_vl.Qwen3VLMoeForConditionalGeneration if moe else mm_models_vl.Qwen3VLForConditionalGeneration
    return reference, ours.from_pretrained(path)


@pytest.mark.parametrize("case", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "omni"])
def test_a_left_padded_batch_decodes_as_transformers_generate(case, tmp_path):
    reference, ours = _models(case, tmp_path)
    inputs = _prompts(case)
    assert (inputs["attention_mask"][:, 0] == 0).any()  # a row really is padded on the left
    assert_decodes_like_reference(reference, ours, inputs, STEPS)


def test_generate_takes_padded_batches_samples_and_returns_several_completions(tmp_path):
    """`generate`'s transformers keywords: greedy rows equal transformers'; sampled rows are
    reproducible by seed, differ by seed, and with top_k=1 are the greedy ones."""
    reference, ours = _models("qwen2_5_vl", tmp_path)
    inputs = _prompts("qwen2_5_vl")
    kwargs = {k: torch.from_numpy(v) for k, v in inputs.items()}
    expected = reference.generate(**kwargs, max_new_tokens=6, do_sample=False).numpy()
    greedy = ours.generate(**inputs, max_new_tokens=6)
    np.testing.assert_array_equal(greedy, expected)
    sampled = ours.generate(**inputs, max_new_tokens=6, do_sample=True, temperature=1.5, num_return_sequences=3,
                            seed=5)
    assert sampled.shape[0] == 6
    np.testing.assert_array_equal(sampled, ours.generate(**inputs, max_new_tokens=6, do_sample=True,
                                                         temperature=1.5, num_return_sequences=3, seed=5))
    assert not np.array_equal(sampled, ours.generate(**inputs, max_new_tokens=6, do_sample=True, temperature=1.5,
                                                     num_return_sequences=3, seed=6))
    assert len({tuple(row) for row in sampled[:3]}) > 1  # a prompt's copies draw their own tokens
    top1 = ours.generate(**inputs, max_new_tokens=6, do_sample=True, top_k=1, num_return_sequences=2, seed=5)
    np.testing.assert_array_equal(top1, np.repeat(greedy, 2, 0))
