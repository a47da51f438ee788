"""Qwen2.5-VL in bf16 against transformers run in bf16 on torch CPU, same weights and inputs.

Tolerances come from the reference itself: the bf16 reference's distance to the fp32 one is the
noise bf16 adds; ours in (emulated) bf16 must be within twice that of the bf16 reference, the loss
within 1e-2, and visibly off the fp32 run (the rounding is really there). A bf16 save is what
transformers loads as bf16, and an fp32 folder loads into a bf16 model by one cast."""

import json

import numpy as np
import pytest
import torch
from helpers.qwen_vl_reference import our_forward, reference_forward, rel_err, sample, write_reference
from helpers.torch_reference import rms_err


@pytest.fixture(scope="module")
def bf16_models(tmp_path_factory):
    from mm_models_vl import Qwen2_5_VLForConditionalGeneration
    from mm_parallel import precision

    path = tmp_path_factory.mktemp("qwen2_5_vl_bf16")
    reference = write_reference(path)
    fp32 = Qwen2_5_VLForConditionalGeneration.from_pretrained(path)
    ours = Qwen2_5_VLForConditionalGeneration.from_pretrained(path)
    precision.apply(ours, precision.Precision("bf16"))
    yield path, reference, fp32, ours
    precision.activate(precision.Precision())


def _report(name, **errors):
    print(f"\n{name}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))


@pytest.mark.parametrize("case", ["text", "image_video"])
def test_bf16_matches_transformers_bf16(bf16_models, case):
    from mm_parallel import precision

    _, reference, fp32, ours = bf16_models
    inputs = sample(case, np.random.default_rng(3))
    ref32 = reference_forward(reference, inputs)
    precision.activate(precision.Precision())
    ours32 = our_forward(fp32, inputs)
    precision.activate(precision.Precision("bf16"))
    ref16 = reference_forward(reference.to(torch.bfloat16), inputs)
    reference.float()
    ours16 = our_forward(ours, inputs)

    noise = rms_err(ref16[1], ref32[1])  # what bf16 does to the logits
    logits = rms_err(ours16[1], ref16[1])
    loss = abs(ours16[0] - ref16[0]) / abs(ref16[0])
    grads = {n: rms_err(ours16[2][n], g) for n, g in ref16[2].items()}
    grad_noise = {n: rms_err(g, ref32[2][n]) for n, g in ref16[2].items()}
    _report(case, loss=loss, logits=logits, logits_bf16_noise=noise, logits_max=rel_err(ours16[1], ref16[1]),
            median_grad=np.median(list(grads.values())), median_grad_bf16_noise=np.median(list(grad_noise.values())),
            worst_grad=max(grads.values()), worst_grad_bf16_noise=max(grad_noise.values()),
            off_fp32=rms_err(ours16[1], ours32[1]))
    assert loss <= 1e-2
    assert logits <= 2 * noise
    assert rms_err(ours16[1], ours32[1]) >= 0.25 * noise  # the emulation rounds
    assert np.median(list(grads.values())) <= 2 * np.median(list(grad_noise.values()))
    assert max(grads.values()) <= 2 * max(grad_noise.values())


def test_bf16_save_loads_in_transformers_as_bf16(bf16_models, tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration as Reference

    from mm_models_vl import Qwen2_5_VLForConditionalGeneration

    path, _, fp32, ours = bf16_models
    ours.save_pretrained(tmp_path / "bf16")
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    back = Reference.from_pretrained(str(tmp_path / "bf16"))
    assert back.dtype == torch.bfloat16
    mine = {n: p.astype("float32").asnumpy() for n, p in ours.parameters_and_names()}
    theirs = {n: p.detach().float().numpy() for n, p in back.named_parameters()}
    assert set(mine) == set(theirs)
    for name, value in mine.items():
        np.testing.assert_array_equal(value, theirs[name], err_msg=name)
    # ours is the fp32 folder cast once (the fixture); saved as fp32 it widens exactly, and loads back as it was
    ours.save_pretrained(tmp_path / "fp32", dtype="fp32")
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())["dtype"] == "float32"
    again = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "fp32")
    for name, p in again.parameters_and_names():
        assert p.dtype == fp32.parameters_dict()[name].dtype
        np.testing.assert_array_equal(p.asnumpy(), mine[name], err_msg=name)
