"""from_pretrained reads what transformers writes (one file, sharded with an index, bfloat16; the
released checkpoints' key layout, which transformers 5.24 still writes, and the module-name layout);
transformers loads what save_pretrained writes, in the same layout."""

import json

import numpy as np
import pytest
import torch  # noqa: F401  (the parity reference: required, see tests/conftest.py)
from helpers.qwen_vl_reference import our_forward, reference_forward, rel_err, sample, write_reference


def _params(model):
    return {name: p.asnumpy() for name, p in model.parameters_and_names()}


def test_sharded_bf16_and_legacy_checkpoints_load(tmp_path):
    from safetensors.torch import load_file, save_file

    from mm_models_vl import Qwen2_5_VLForConditionalGeneration as Ours

    reference = write_reference(tmp_path / "one")
    expected = {name: p.detach().numpy() for name, p in reference.named_parameters()}
    baseline = _params(Ours.from_pretrained(tmp_path / "one"))
    assert set(baseline) == set(expected)
    assert all(np.array_equal(baseline[n], expected[n]) for n in expected)

    reference.save_pretrained(str(tmp_path / "sharded"), max_shard_size="20KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    sharded = _params(Ours.from_pretrained(tmp_path / "sharded"))
    assert all(np.array_equal(sharded[n], expected[n]) for n in expected)

    reference.to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"))
    reference.float()
    bf16 = _params(Ours.from_pretrained(tmp_path / "bf16"))
    widened = {n: p.detach().to(torch.bfloat16).float().numpy() for n, p in reference.named_parameters()}
    assert all(np.array_equal(bf16[n], widened[n]) for n in expected)

    # transformers writes the released checkpoints' layout (model.layers.*, visual.*); module names load too
    on_disk = load_file(str(tmp_path / "one" / "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.weight" in on_disk and "visual.merger.mlp.0.weight" in on_disk
    renamed = {("model.language_model." + n[len("model."):] if n.startswith("model.") else
                "model.visual." + n[len("visual."):] if n.startswith("visual.") else n): t for n, t in on_disk.items()}
    (tmp_path / "modules").mkdir()
    save_file(renamed, str(tmp_path / "modules" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "modules" / "config.json").write_text((tmp_path / "one" / "config.json").read_text())
    by_module_name = _params(Ours.from_pretrained(tmp_path / "modules"))
    assert all(np.array_equal(by_module_name[n], expected[n]) for n in expected)


def test_transformers_loads_what_we_save(tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration as Reference

    from mm_models_vl import Qwen2_5_VLForConditionalGeneration as Ours

    write_reference(tmp_path / "in")
    ours = Ours.from_pretrained(tmp_path / "in")
    inputs = sample("image_video", np.random.default_rng(0))
    loss, logits, _ = our_forward(ours, inputs, backward=False)
    ours.save_pretrained(tmp_path / "out")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / "model.safetensors"), "np") as ours_file, \
            safe_open(str(tmp_path / "in" / "model.safetensors"), "np") as theirs:
        assert sorted(ours_file.keys()) == sorted(theirs.keys())  # the same on-disk layout
    reloaded = Reference.from_pretrained(str(tmp_path / "out"), attn_implementation="eager").eval()
    ref_loss, ref_logits, _ = reference_forward(reloaded, inputs, backward=False)
    assert rel_err(logits, ref_logits) <= 1e-5 and abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)


def test_tied_embeddings_round_trip(tmp_path):
    from safetensors import safe_open
    from transformers import Qwen2_5_VLForConditionalGeneration as Reference

    from mm_models_vl import Qwen2_5_VLForConditionalGeneration as Ours

    reference = write_reference(tmp_path / "in", tie=True)
    assert reference.config.tie_word_embeddings
    ours = Ours.from_pretrained(tmp_path / "in")
    assert ours.lm_head.weight is ours.model.language_model.embed_tokens.weight
    inputs = sample("image", np.random.default_rng(1))
    _, logits, _ = our_forward(ours, inputs, backward=False)
    _, ref_logits, _ = reference_forward(reference, inputs, backward=False)
    assert rel_err(logits, ref_logits) <= 1e-5
    ours.save_pretrained(tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "np") as f:
        assert "lm_head.weight" not in f.keys()
    reloaded = Reference.from_pretrained(str(tmp_path / "out"), attn_implementation="eager").eval()
    _, again, _ = reference_forward(reloaded, inputs, backward=False)
    assert rel_err(again, ref_logits) <= 1e-6


def test_missing_or_mismatched_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from mm_models_vl import Qwen2_5_VLForConditionalGeneration as Ours

    write_reference(tmp_path / "in")
    state = load_file(str(tmp_path / "in" / "model.safetensors"))
    del state["model.norm.weight"]
    save_file(state, str(tmp_path / "in" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(KeyError, match="model.norm.weight"):
        Ours.from_pretrained(tmp_path / "in")
    with pytest.raises(ValueError, match="weight: checkpoint shape .* does config.json match"):
        Ours.from_pretrained(tmp_path / "in", hidden_size=128)
