"""Diffusion-DPO (mm_parallel.preference.DiffusionPairs as `preference`) on tiny Wan2.1 and
CogVideoX transformers: two clip pairs, each pair's clips sharing their timestep and prompt; the
loss -log sigmoid(-beta ((e_w - r_w) - (e_l - r_l))) — e each sample's mean squared error of the
prediction (Wan: the flow-matching velocity, CogVideoX: v), written out here on diffusers'
models' predictions (Wallace et al. 2023) — and every gradient equal mm's (loss rel 1e-5,
gradients 1e-4 of their scale); a large beta (margins far below -100) stays finite."""

import diffusers  # noqa: F401  (the parity reference: required, see tests/conftest.py)
import numpy as np
import pytest
from helpers import cogvideox_reference, wan_reference

from mm_parallel.preference import DiffusionPairs

FAMILIES = {  # name: (write the reference, the batch of 4, our class)
    "wan": (lambda path: wan_reference.write_reference(path),
            lambda rng: wan_reference.inputs(rng, batch=4), "WanTransformer3DModel"),
    "cogvideox": (lambda path: cogvideox_reference.write_reference(path, "1.0-2b"),
                  lambda rng: cogvideox_reference.inputs(rng, "1.0-2b", batch=4), "CogVideoXTransformer3DModel"),
}


@pytest.mark.parametrize("family, beta", [("wan", 50.0), ("wan", 500.0), ("cogvideox", 50.0)])
def test_diffusion_dpo_equals_the_formula_on_diffusers(tmp_path, family, beta):
    import torch

    import mm_models_video

    write, make_inputs, ours_name = FAMILIES[family]
    reference = write(tmp_path)
    ours = getattr(mm_models_video, ours_name).from_pretrained(str(tmp_path))
    rng = np.random.default_rng(3)
    batch = make_inputs(rng)
    for key in ("timestep", "encoder_hidden_states"):  # a pair's clips share the timestep and the prompt
        batch[key] = np.repeat(batch[key][:2], 2, axis=0)
    ref_errors = rng.uniform(0.5, 1.5, 4).astype(np.float32)  # rows [w0, l0, w1, l1]

    reference.zero_grad()
    sample = reference(**{k: torch.from_numpy(v) for k, v in batch.items() if k != "target"}).sample
    errors = ((sample - torch.from_numpy(batch["target"])) ** 2).mean(dim=(1, 2, 3, 4))
    margin = (errors[0::2] - torch.from_numpy(ref_errors[0::2])) - (errors[1::2] - torch.from_numpy(ref_errors[1::2]))
    want = -torch.nn.functional.logsigmoid(-beta * margin).mean()
    want.backward()
    want_grads = {n: p.grad.numpy().copy() for n, p in reference.named_parameters() if p.grad is not None}

    batch["preference"] = DiffusionPairs(np.array([0, 2]), np.array([1, 3]), ref_errors[0::2], ref_errors[1::2],
                                         pairs_in_batch=2, beta=beta)
    loss, _, grads = wan_reference.our_forward(ours, batch)
    assert loss == pytest.approx(float(want.detach()), rel=1e-5)
    # relative to each gradient's scale, floored at 1e-3 of the largest: CogVideoX's key bias has a
    # zero gradient in exact arithmetic (it shifts a query's scores equally), rounding in both
    floor = 1e-3 * max(np.abs(g).max() for g in want_grads.values())
    errors = {name: np.abs(grads[name] - g).max() / max(np.abs(g).max(), floor) for name, g in want_grads.items()}
    assert max(errors.values()) <= 1e-4, sorted(errors.items(), key=lambda kv: -kv[1])[:5]
