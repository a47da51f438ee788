"""The shipped real-size recipes at their per-rank shapes on the Ascend path's strict stand-ins.

For each real-size recipe, a model of 1-2 layers at the widths one rank of the recipe's layout
computes with (tests/helpers/real_widths.py: heads and kv heads over tp x Ulysses, head sizes as
published; the towers whole, as published; vocabulary 4,096; 8 experts) runs a training step's
forward and backward in bf16 — the kernels take bf16 operands, as on Ascend — on a batch with
left padding and a sample of padding alone. The stand-ins refuse any call MindSpore 2.7.2's pages
forbid and return NaN where they leave a result undefined, so the step passing with a finite loss
and finite gradients says: no call outside the documentation, no NaN. (The optimizer's update,
which calls no Ascend kernel, is left out: at these widths it was half the step's 14 s here.)
The DiTs take no attention mask (the pipelines pad the text with zeros); their padded form, a
joint sequence padded to split evenly, runs on the stand-ins in the two-process padded_* cases.
"""

import json

import mindspore as ms
import numpy as np
import pytest
from helpers import real_widths

from mm_train.recipe import load_recipe

VL = {  # recipe: (hub config, family)
    "qwen2_5_vl_7b_sft": ("Qwen2.5-VL-7B-Instruct", "qwen2_5_vl"),
    "qwen2_5_vl_72b_sft": ("Qwen2.5-VL-72B-Instruct", "qwen2_5_vl"),
    "qwen3_vl_8b_sft": ("Qwen3-VL-8B-Instruct", "qwen3_vl"),
    "qwen3_vl_30b_a3b_sft": ("Qwen3-VL-30B-A3B-Instruct", "qwen3_vl_moe"),
    "qwen2_5_omni_7b_sft": ("Qwen2.5-Omni-7B", "omni"),
}

VIDEO = {  # recipe: (hub config, model class name)
    "wan2_1_t2v_1_3b": ("Wan2.1-T2V-1.3B-Diffusers/transformer", "WanTransformer3DModel"),
    "wan2_1_t2v_14b": ("Wan2.1-T2V-14B-Diffusers/transformer", "WanTransformer3DModel"),
    "cogvideox_5b_t2v": ("CogVideoX-5b/transformer", "CogVideoXTransformer3DModel"),
    "cogvideox1_5_5b_i2v": ("CogVideoX1.5-5B-I2V/transformer", "CogVideoXTransformer3DModel"),
}


def _recipe(name, hub_key, tmp_path):
    folder = tmp_path / "hub"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(real_widths.HUB_CONFIGS[hub_key]))
    return load_recipe(name, [f"model.path={folder}"])


def _vl_model_and_batch(family, hub_key, parallel):
    """(model class, per-rank config.json, the padded batch) of a VL family."""
    import mm_models_vl

    if family == "omni":
        from helpers import omni_parallel_cases, omni_reference

        raw = real_widths.omni_config(hub_key, omni_reference.tiny_config(), parallel)
        batch = omni_parallel_cases.batch()
        mel, frames = raw["audio_config"]["num_mel_bins"], batch["input_features"].shape[-1]
        batch["input_features"] = np.random.default_rng(2).standard_normal(
            (batch["input_features"].shape[0], mel, frames)).astype(np.float32)
        return (mm_models_vl.Qwen2_5OmniThinkerForConditionalGeneration, raw,
                real_widths.padded(batch, 3, omni_reference.with_labels))
    if family == "qwen2_5_vl":
        from helpers import qwen_vl_parallel_cases, qwen_vl_reference

        raw = real_widths.vl_config(hub_key, qwen_vl_reference.tiny_config(), parallel)
        return (mm_models_vl.Qwen2_5_VLForConditionalGeneration, raw,
                real_widths.padded(qwen_vl_parallel_cases.batch(), 3, qwen_vl_reference.with_types_and_labels))
    from helpers import qwen3_vl_parallel_cases, qwen3_vl_reference

    moe = family == "qwen3_vl_moe"
    raw = real_widths.vl_config(hub_key, qwen3_vl_reference.tiny_config(moe=moe), parallel)
    cls = mm_models_vl.Qwen3VLMoeForConditionalGeneration if moe else mm_models_vl.Qwen3VLForConditionalGeneration
    return cls, raw, real_widths.padded(qwen3_vl_parallel_cases.batch(), 3, qwen3_vl_reference.with_types_and_labels)


def _one_step(cls, raw, batch, loss=None):
    """(loss, gradients, the stand-ins called) of one bf16 forward and backward (``loss(model,
    batch)``: the model's own by default)."""
    from mm_parallel import ParallelConfig, precision
    from mm_parallel.testing.device_path import ascend_stand_ins
    from mm_parallel.testing.equivalence import ModelSpec, loss_and_grads
    from mm_parallel.topology import Topology

    topo = Topology.build(ParallelConfig(), 1, 0)
    model = cls(cls.load_config(raw), topo)
    precision.apply(model, precision.Precision("bf16"))
    spec = ModelSpec(build=None, split=None, samples=len, **({"loss": loss} if loss else {}))
    try:
        with ascend_stand_ins(float32=False) as calls:
            loss, grads = loss_and_grads(spec, [model], topo, batch)
            made = sorted(set(calls))
    finally:
        precision.activate(precision.Precision())
    return loss, [g.astype(ms.float32).asnumpy() for g in grads], made


@pytest.mark.parametrize("name", list(VL))
def test_a_vl_recipe_steps_at_its_per_rank_shapes_on_the_strict_stand_ins(name, tmp_path):
    hub_key, family = VL[name]
    recipe = _recipe(name, hub_key, tmp_path)
    cls, raw, batch = _vl_model_and_batch(family, hub_key, recipe.parallel)
    assert batch["attention_mask"][:, 0].tolist() == [0] * batch["input_ids"].shape[0]  # left padding everywhere
    assert not batch["attention_mask"][-1].any()  # and a sample of padding alone
    loss, grads, calls = _one_step(cls, raw, batch)
    assert np.isfinite(loss), loss
    assert all(np.isfinite(g).all() for g in grads)
    want = {"flash_attention_score", "rms_norm", "rotary_position_embedding", "swiglu"}
    assert want | ({"grouped_matmul"} if "num_experts" in raw["text_config"] else set()) <= set(calls), calls


@pytest.mark.parametrize("name", list(VIDEO))
def test_a_video_recipe_steps_at_its_per_rank_shapes_on_the_strict_stand_ins(name, tmp_path):
    import mm_models_video

    hub_key, class_name = VIDEO[name]
    recipe = _recipe(name, hub_key, tmp_path)
    raw = real_widths.dit_config(hub_key, recipe.parallel)
    cls = getattr(mm_models_video, class_name)
    batch = real_widths.dit_batch(raw, np.random.default_rng(0))
    loss, grads, calls = _one_step(cls, raw, batch, _dit_loss(raw))
    assert np.isfinite(loss), loss
    assert all(np.isfinite(g).all() for g in grads)
    assert {"flash_attention_score", "rotary_position_embedding"} <= set(calls), calls


def _dit_loss(raw):
    """Wan's loss is the model's own; CogVideoX's forward takes the pipeline's rotary tables."""
    if "text_dim" in raw:
        return None
    from mm_models_video.cogvideox import rotary_tables

    def loss(model, batch):
        frames, height, width = batch["hidden_states"].shape[1], *batch["hidden_states"].shape[3:]
        return model(**batch, image_rotary_emb=rotary_tables(model.config, frames, height, width)).loss

    return loss
