"""WanExperts, Wan2.2 A14B's pair of experts as one model: read from a pipeline folder
(model_index.json's boundary_ratio), each micro-batch run by the expert its timesteps choose —
equal to diffusers' transformer (t >= boundary x 1000) or transformer_2 (below), the other
expert's gradients zero; a micro-batch straddling the boundary, or needing an expert the model
does not hold, is refused; save_pretrained writes the hub's layout, each expert loaded unchanged by
diffusers and the pair by its WanPipeline."""

import json

import diffusers  # noqa: F401  (the parity reference: required, see tests/conftest.py)
import numpy as np
import pytest
from helpers.torch_reference import rel_err
from helpers.wan_reference import inputs, our_forward, reference_forward, write_reference

BOUNDARY = 0.875


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan2_2_a14b")
    high = write_reference(root / "transformer", seed=0)
    low = write_reference(root / "transformer_2", seed=1)
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "WanPipeline", "boundary_ratio": BOUNDARY, "expand_timesteps": False,
        "transformer": ["diffusers", "WanTransformer3DModel"], "transformer_2": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"]}))
    return root, {"transformer": high, "transformer_2": low}


@pytest.mark.parametrize("timesteps, expert", [([900.0, 875.0], "transformer"), ([874.0, 20.0], "transformer_2")])
def test_each_micro_batch_runs_the_expert_its_timesteps_choose(pipeline, timesteps, expert):
    from mm_models_video import WanExperts

    root, references = pipeline
    model = WanExperts.from_pretrained(root)
    assert model.names == ["transformer", "transformer_2"] and model.boundary == BOUNDARY * 1000
    batch = {**inputs(np.random.default_rng(0)), "timestep": np.array(timesteps, np.float32)}
    ref_loss, ref_sample, ref_grads = reference_forward(references[expert], batch)
    loss, sample, grads = our_forward(model, batch)
    assert rel_err(sample, ref_sample) <= 1e-5 and abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    other = "transformer_2" if expert == "transformer" else "transformer"
    assert {n.split(".", 1)[1] for n in grads if n.startswith(expert + ".")} == set(ref_grads)
    worst = max(ref_grads, key=lambda n: rel_err(grads[f"{expert}.{n}"], ref_grads[n]))
    assert rel_err(grads[f"{expert}.{worst}"], ref_grads[worst]) <= 1e-4, worst
    unused = [g for n, g in grads.items() if n.startswith(other + ".")]
    assert unused and all(not np.any(g) for g in unused)  # present, zero: reduced with the rest


def test_bad_micro_batches_and_missing_experts_are_refused(pipeline):
    from mm_models_video import WanExperts

    root, _ = pipeline
    batch = {**inputs(np.random.default_rng(0)), "timestep": np.array([900.0, 100.0], np.float32)}
    with pytest.raises(ValueError, match="straddle the experts' boundary 875"):
        WanExperts.from_pretrained(root)(**batch)
    high = WanExperts.choosing("high_noise").from_pretrained(root)
    assert high.names == ["transformer"]
    with pytest.raises(ValueError, match="need the transformer_2 expert, which this model does not hold"):
        high(**{**batch, "timestep": np.array([100.0, 100.0], np.float32)})
    with pytest.raises(ValueError, match="model.expert 'middle' is not one of"):
        WanExperts.choosing("middle")


def test_a_one_expert_model_samples_with_a_borrowed_expert(pipeline):
    """A high-noise-only model lends transformer_2 for the low timesteps (a one-expert run's
    samples): equal to diffusers' transformer_2 there, frozen, not one of the model's own."""
    from mm_models_video import WanExperts, WanTransformer3DModel

    root, references = pipeline
    high = WanExperts.choosing("high_noise").from_pretrained(root)
    assert high.missing() == ["transformer_2"]
    high.borrow("transformer_2", WanTransformer3DModel.from_pretrained(root / "transformer_2"))
    assert high.names == ["transformer"] and not high.missing()
    assert not any(p.requires_grad for p in high.transformer_2.get_parameters())
    batch = {**inputs(np.random.default_rng(0)), "timestep": np.array([100.0, 300.0], np.float32)}
    _, ref_sample, _ = reference_forward(references["transformer_2"], batch, backward=False)
    assert rel_err(high(**batch).sample.asnumpy(), ref_sample) <= 1e-5


def test_save_pretrained_writes_the_hub_layout_diffusers_loads(pipeline, tmp_path):
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    from mm_models_video import WanExperts

    root, references = pipeline
    WanExperts.from_pretrained(root).save_pretrained(tmp_path / "saved")
    index = json.loads((tmp_path / "saved" / "model_index.json").read_text())
    assert index["boundary_ratio"] == BOUNDARY and index["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    assert "vae" not in index  # the experts only: the pipeline's other parts come from the model folder
    for name, reference in references.items():
        back = WanTransformer3DModel.from_pretrained(str(tmp_path / "saved" / name)).state_dict()
        assert all(torch.equal(back[k], v) for k, v in reference.state_dict().items()), name
    pipe = WanPipeline.from_pretrained(str(tmp_path / "saved"), vae=None, text_encoder=None, tokenizer=None,
                                       scheduler=FlowMatchEulerDiscreteScheduler())
    assert pipe.config.boundary_ratio == BOUNDARY
    for name, reference in references.items():
        loaded = getattr(pipe, name).state_dict()
        assert all(torch.equal(loaded[k], v) for k, v in reference.state_dict().items()), name
    low = WanExperts.choosing("low_noise").from_pretrained(root)
    low.save_pretrained(tmp_path / "low")
    index = json.loads((tmp_path / "low" / "model_index.json").read_text())
    assert index["transformer"] == [None, None] and not (tmp_path / "low" / "transformer").exists()
    assert WanExperts.from_pretrained(tmp_path / "low").names == ["transformer_2"]  # resumes what it wrote
