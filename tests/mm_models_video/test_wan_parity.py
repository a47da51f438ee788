"""WanTransformer3DModel equals diffusers' on the same safetensors weights: T2V and I2V samples
(rel-err <= 1e-5), the flow-matching loss and every parameter gradient (<= 1e-4); Wan2.2's
per-token timesteps (TI2V's first frame at 0, and every token its own)."""

import json

import diffusers  # noqa: F401  (the parity reference: required, see tests/conftest.py)
import numpy as np
import pytest
from helpers.torch_reference import rel_err
from helpers.wan_reference import inputs, our_forward, reference_forward, write_reference

CASES = {
    "t2v": dict(i2v=False),
    "i2v": dict(i2v=True),
    "t2v_odd_grid": dict(i2v=False, frames=5, size=(6, 10), batch=1),
    "i2v_one_sample": dict(i2v=True, frames=1, size=(4, 6), batch=1, image_len=3),
    "ti2v_first_frame": dict(i2v=False, token_timesteps="first_frame"),
    "t2v_token_timesteps": dict(i2v=False, frames=2, size=(4, 6), token_timesteps="random"),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan")
    return {kind: (root / kind, write_reference(root / kind, i2v=kind == "i2v")) for kind in ("t2v", "i2v")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_loss_and_gradients_equal_diffusers(folders, case):
    from mm_models_video import WanTransformer3DModel

    kwargs = dict(CASES[case])
    path, reference = folders["i2v" if kwargs["i2v"] else "t2v"]
    batch = inputs(np.random.default_rng(len(case)), **kwargs)
    model = WanTransformer3DModel.from_pretrained(path)
    ref_loss, ref_sample, ref_grads = reference_forward(reference, batch)
    loss, sample, grads = our_forward(model, batch)
    assert sample.shape == ref_sample.shape
    assert rel_err(sample, ref_sample) <= 1e-5
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert set(grads) == set(ref_grads)
    worst = max(grads, key=lambda n: rel_err(grads[n], ref_grads[n]))
    assert rel_err(grads[worst], ref_grads[worst]) <= 1e-4, worst


def test_save_pretrained_is_loaded_unchanged_by_diffusers(folders, tmp_path):
    import torch
    from diffusers import WanTransformer3DModel as Reference

    from mm_models_video import WanTransformer3DModel

    path, reference = folders["i2v"]
    WanTransformer3DModel.from_pretrained(path).save_pretrained(tmp_path / "out")
    back = Reference.from_pretrained(str(tmp_path / "out")).float().eval()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["_class_name"] == "WanTransformer3DModel"
    want = reference.state_dict()
    got = back.state_dict()
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_bad_config_and_inputs_get_clear_errors(folders, tmp_path):
    from mm_models_video import WanTransformer3DModel, WanTransformerConfig

    with pytest.raises(ValueError, match="did you mean 'num_layers'"):
        WanTransformerConfig.from_dict({"num_layer": 2})
    with pytest.raises(ValueError, match="needs both image_dim and added_kv_proj_dim"):
        WanTransformerConfig(image_dim=8)
    path, _ = folders["t2v"]
    model = WanTransformer3DModel.from_pretrained(path)
    batch = inputs(np.random.default_rng(0))
    with pytest.raises(ValueError, match="cannot be cut into patches"):
        model(**{**batch, "hidden_states": batch["hidden_states"][..., :7]})
    with pytest.raises(ValueError, match="channels"):
        model(**{**batch, "hidden_states": batch["hidden_states"][:, :3]})
    with pytest.raises(ValueError, match="T2V model takes none"):
        model(**batch, encoder_hidden_states_image=np.zeros((2, 3, 48), np.float32))
    with pytest.raises(ValueError, match=r"per-token timestep must be \(batch, tokens\) = \(2, 48\)"):
        model(**{**batch, "timestep": np.zeros((2, 47), np.float32)})
