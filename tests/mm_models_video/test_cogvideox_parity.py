"""CogVideoXTransformer3DModel equals diffusers' on the same safetensors weights — 1.0 and 1.5, T2V
and I2V, the 2B's sincos positions — sample (rel-err <= 1e-5), loss and every parameter gradient;
its rotary tables equal the diffusers pipeline's; what it saves diffusers loads unchanged."""

import json

import diffusers  # noqa: F401  (the parity reference: required, see tests/conftest.py)
import numpy as np
import pytest
from helpers.cogvideox_reference import CONFIGS, inputs, pipeline_rotary, reference_forward, write_reference
from helpers.torch_reference import rel_err
from helpers.wan_reference import our_forward

CASES = {  # kind, frames, (height, width) of the latents, batch
    "1.0-t2v": ("1.0-t2v", 3, (6, 8), 2),
    "1.0-t2v-cropped-grid": ("1.0-t2v", 2, (4, 8), 1),  # another aspect: the crop region moves
    "1.0-i2v-learned-table": ("1.0-i2v", 3, (6, 8), 2),  # the sample size: the checkpoint's table
    "1.0-i2v-other-length": ("1.0-i2v", 2, (6, 8), 1),  # other frames: the sincos table, as diffusers
    "1.0-2b-sincos": ("1.0-2b", 3, (6, 8), 2),
    "1.0-2b-sincos-other-size": ("1.0-2b", 2, (4, 6), 1),
    "1.5-t2v": ("1.5-t2v", 4, (6, 8), 2),
    "1.5-t2v-smaller": ("1.5-t2v", 2, (4, 4), 1),
    "1.5-i2v": ("1.5-i2v", 4, (6, 8), 2),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    root = tmp_path_factory.mktemp("cogvideox")
    return {kind: (root / kind, write_reference(root / kind, kind)) for kind in CONFIGS}


def _rotary(model, reference, frames, size):
    from mm_models_video.cogvideox import rotary_tables

    if not model.config.use_rotary_positional_embeddings:
        return None, None
    return pipeline_rotary(reference, frames, *size), rotary_tables(model.config, frames, *size)


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_loss_and_gradients_equal_diffusers(references, case):
    from mm_models_video import CogVideoXTransformer3DModel

    kind, frames, size, batch_size = CASES[case]
    path, reference = references[kind]
    batch = inputs(np.random.default_rng(len(case)), kind, batch_size, frames, size)
    model = CogVideoXTransformer3DModel.from_pretrained(path)
    theirs, ours = _rotary(model, reference, frames, size)
    ref_loss, ref_sample, ref_grads = reference_forward(reference, batch, theirs)
    loss, sample, grads = our_forward(model, {**batch, "image_rotary_emb": ours})
    assert sample.shape == ref_sample.shape == batch["target"].shape
    assert rel_err(sample, ref_sample) <= 1e-5
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert set(grads) == set(ref_grads)
    # relative to each gradient's scale, floored at 1e-3 of the largest: without rotary positions
    # the key bias's gradient is zero in exact arithmetic (it shifts a query's scores equally),
    # ~1e-11 of rounding in both
    floor = 1e-3 * max(np.abs(g).max() for g in ref_grads.values())
    errors = {n: np.abs(grads[n] - ref_grads[n]).max() / max(np.abs(ref_grads[n]).max(), floor) for n in grads}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 1e-5, (worst, errors[worst])


@pytest.mark.parametrize("kind", ["1.0-t2v", "1.5-t2v"])
def test_rotary_tables_equal_the_pipelines(references, kind):
    from mm_models_video import CogVideoXTransformerConfig
    from mm_models_video.cogvideox import rotary_tables

    path, reference = references[kind]
    config = CogVideoXTransformerConfig.load(path)
    for frames, size in ((3, (6, 8)), (4, (2, 8)), (2, (6, 2)), (6, (4, 6))):
        want = pipeline_rotary(reference, frames, *size)
        got = rotary_tables(config, frames, *size)
        for a, b in zip(got, want):
            assert a.shape == b.shape and np.abs(a - b).max() <= 1e-6, (frames, size)


def test_save_pretrained_is_loaded_unchanged_by_diffusers(references, tmp_path):
    import torch
    from diffusers import CogVideoXTransformer3DModel as Reference

    from mm_models_video import CogVideoXTransformer3DModel

    for kind in ("1.0-i2v", "1.5-i2v"):
        path, reference = references[kind]
        CogVideoXTransformer3DModel.from_pretrained(path).save_pretrained(tmp_path / kind)
        back = Reference.from_pretrained(str(tmp_path / kind)).float().eval()
        config = json.loads((tmp_path / kind / "config.json").read_text())
        assert config["_class_name"] == "CogVideoXTransformer3DModel"
        want, got = reference.state_dict(), back.state_dict()
        assert set(got) == set(want)  # the learned table (a buffer there) included
        for name in want:
            assert torch.equal(got[name], want[name]), name


def test_bad_config_and_inputs_get_clear_errors(references):
    from mm_models_video import CogVideoXTransformer3DModel, CogVideoXTransformerConfig
    from mm_models_video.cogvideox import rotary_tables

    with pytest.raises(ValueError, match="did you mean 'num_layers'"):
        CogVideoXTransformerConfig.from_dict({"num_layer": 2})
    with pytest.raises(ValueError, match="needs use_rotary_positional_embeddings"):
        CogVideoXTransformerConfig(use_learned_positional_embeddings=True)
    with pytest.raises(ValueError, match="must equal time_embed_dim"):
        CogVideoXTransformerConfig(ofs_embed_dim=256)
    model = CogVideoXTransformer3DModel.from_pretrained(references["1.0-t2v"][0])
    batch = inputs(np.random.default_rng(0), "1.0-t2v")
    rotary = {"image_rotary_emb": rotary_tables(model.config, 3, 6, 8)}
    with pytest.raises(ValueError, match="pass image_rotary_emb"):
        model(**batch)
    with pytest.raises(ValueError, match="cannot be cut into patches"):
        model(**{**batch, "hidden_states": batch["hidden_states"][..., :7]}, **rotary)
    with pytest.raises(ValueError, match="channels"):
        model(**{**batch, "hidden_states": batch["hidden_states"][:, :, :3]}, **rotary)
    with pytest.raises(ValueError, match="each must be"):
        model(**batch, image_rotary_emb=tuple(t[:5] for t in rotary["image_rotary_emb"]))
    with pytest.raises(ValueError, match="cond_proj"):
        model(**batch, **rotary, timestep_cond=np.zeros((2, 4), np.float32))
    sincos = CogVideoXTransformer3DModel.from_pretrained(references["1.0-2b"][0])
    with pytest.raises(ValueError, match="max_text_seq_length=7"):
        sincos(**inputs(np.random.default_rng(0), "1.0-2b", text_len=5))
    learned = CogVideoXTransformer3DModel.from_pretrained(references["1.0-i2v"][0])
    with pytest.raises(ValueError, match="sample size"):
        learned(**inputs(np.random.default_rng(0), "1.0-i2v", size=(4, 8)),
                image_rotary_emb=rotary_tables(learned.config, 3, 4, 8))
    ofs_model = CogVideoXTransformer3DModel.from_pretrained(references["1.5-i2v"][0])
    batch = inputs(np.random.default_rng(0), "1.5-i2v", frames=4)
    del batch["ofs"]
    with pytest.raises(ValueError, match="needs ofs"):
        ofs_model(**batch, image_rotary_emb=rotary_tables(ofs_model.config, 4, 6, 8))
