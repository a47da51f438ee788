"""WanTransformer3DModel in bf16 against diffusers run in bf16 on torch CPU (its
``_keep_in_fp32_modules`` in fp32 in both), same weights and inputs (T2V, I2V, and Wan2.2 TI2V's
per-token timesteps).

As for Qwen2.5-VL (tests/mm_models_vl/test_qwen2_5_vl_bf16.py) the tolerance is the bf16
reference's own distance to the fp32 one: ours within twice that, the loss within 1e-2."""

import diffusers  # noqa: F401  (the parity reference: required, see tests/conftest.py)
import numpy as np
import pytest
import torch
from helpers.torch_reference import rel_err, rms_err
from helpers.wan_reference import inputs, our_forward, write_reference


def bf16_values(a):
    """float32 values a bf16 tensor holds (the inputs both sides get)."""
    return torch.from_numpy(np.asarray(a, np.float32)).bfloat16().float().numpy()


def torch_forward(model, batch, dtype):
    """(loss, sample, grads) of diffusers' model run in ``dtype`` (the timestep stays float32)."""
    model.zero_grad()
    kwargs = {k: torch.from_numpy(np.asarray(v)) for k, v in batch.items() if k != "target"}
    kwargs = {k: v if k == "timestep" else v.to(dtype) for k, v in kwargs.items()}
    sample = model(**kwargs).sample
    loss = ((sample.float() - torch.from_numpy(batch["target"])) ** 2).mean()
    loss.backward()
    grads = {n: p.grad.float().numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), sample.detach().float().numpy(), grads


@pytest.mark.parametrize("i2v, token_timesteps", [(False, ""), (True, ""), (False, "first_frame")],
                         ids=["t2v", "i2v", "ti2v"])
def test_bf16_matches_diffusers_bf16(tmp_path, i2v, token_timesteps):
    from diffusers import WanTransformer3DModel as Reference

    from mm_models_video import WanTransformer3DModel
    from mm_parallel import precision

    write_reference(tmp_path, i2v=i2v)
    batch = inputs(np.random.default_rng(5), i2v=i2v, token_timesteps=token_timesteps)
    batch = {k: v if k in ("timestep", "target") else bf16_values(v) for k, v in batch.items()}
    ref32 = torch_forward(Reference.from_pretrained(str(tmp_path)).float(), batch, torch.float32)
    reference = Reference.from_pretrained(str(tmp_path), torch_dtype=torch.bfloat16)
    kept = {n for n, p in reference.named_parameters() if p.dtype == torch.float32}
    ref16 = torch_forward(reference, batch, torch.bfloat16)
    ours32 = our_forward(WanTransformer3DModel.from_pretrained(tmp_path), batch)
    model = WanTransformer3DModel.from_pretrained(tmp_path)
    try:
        precision.apply(model, precision.Precision("bf16"))
        ours_kept = {n for n, p in model.parameters_and_names() if p.dtype == precision.DTYPES["fp32"]}
        ours16 = our_forward(model, batch)
    finally:
        precision.activate(precision.Precision())
    assert ours_kept == kept and kept  # the same modules stay fp32 (time_embedder, scale_shift_table)

    noise = rms_err(ref16[1], ref32[1])
    sample = rms_err(ours16[1], ref16[1])
    loss = abs(ours16[0] - ref16[0]) / abs(ref16[0])
    grads = {n: rms_err(ours16[2][n], g) for n, g in ref16[2].items()}
    grad_noise = {n: rms_err(g, ref32[2][n]) for n, g in ref16[2].items()}
    kind = "i2v" if i2v else token_timesteps or "t2v"
    print(f"\n{kind}: loss {loss:.2e}, sample {sample:.2e} (bf16 noise {noise:.2e}, max "
          f"{rel_err(ours16[1], ref16[1]):.2e}), median grad {np.median(list(grads.values())):.2e} (noise "
          f"{np.median(list(grad_noise.values())):.2e}), worst grad {max(grads.values()):.2e} (noise "
          f"{max(grad_noise.values()):.2e}), off fp32 {rms_err(ours16[1], ours32[1]):.2e}")
    assert loss <= 1e-2
    assert sample <= 2 * noise
    assert rms_err(ours16[1], ours32[1]) >= 0.25 * noise
    assert set(grads) == set(ours16[2])
    assert np.median(list(grads.values())) <= 2 * np.median(list(grad_noise.values()))
    assert max(grads.values()) <= 2 * max(grad_noise.values())
