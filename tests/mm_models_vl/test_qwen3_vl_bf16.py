"""Qwen3-VL-MoE in bf16 (experts and routers included; router logits in fp32) against transformers
run in bf16: loss within 1e-2, logits within twice the bf16 reference's own distance to fp32; its
bf16 save is what transformers loads, bit for bit (the fused expert tensors in bf16)."""

import numpy as np
import torch
from helpers.qwen3_vl_reference import sample, write_reference
from helpers.qwen_vl_reference import our_forward, reference_forward
from helpers.torch_reference import rms_err


def test_moe_bf16_matches_transformers_bf16_and_saves_what_it_loads(tmp_path):
    from transformers import Qwen3VLMoeForConditionalGeneration as Reference

    from mm_models_vl import Qwen3VLMoeForConditionalGeneration
    from mm_parallel import precision

    reference = write_reference(tmp_path / "in", moe=True)
    inputs = sample("image", np.random.default_rng(0))
    ref32 = reference_forward(reference, inputs, backward=False)
    ref16 = reference_forward(reference.to(torch.bfloat16), inputs, backward=False)
    ours = Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path / "in")
    try:
        precision.apply(ours, precision.Precision("bf16"))
        got = our_forward(ours, inputs, backward=False)
        ours.save_pretrained(tmp_path / "out")
    finally:
        precision.activate(precision.Precision())
    noise = rms_err(ref16[1], ref32[1])
    print(f"\nloss {abs(got[0] - ref16[0]) / ref16[0]:.2e}, logits {rms_err(got[1], ref16[1]):.2e} (bf16 noise "
          f"{noise:.2e})")
    assert abs(got[0] - ref16[0]) <= 1e-2 * abs(ref16[0])
    assert rms_err(got[1], ref16[1]) <= 2 * noise

    back = Reference.from_pretrained(str(tmp_path / "out"))
    assert back.dtype == torch.bfloat16
    theirs = {n: p.detach().float().numpy() for n, p in back.named_parameters()}
    mine = {n: p.astype("float32").asnumpy() for n, p in ours.parameters_and_names()}
    assert set(mine) == set(theirs)
    for name, value in mine.items():
        np.testing.assert_array_equal(value, theirs[name], err_msg=name)
