"""train.objective dpo for the video families (Diffusion-DPO, mm_train.preference_step): pairs of
the built-in clips (data_pairs.json: a caption's clip against the square moving the other way),
both clips of a pair cached and given the same noise and timestep; the first step's loss is ln 2
and the reference's errors the policy's; Wan with LoRA (the adapters switched off as the
reference) under pp2 x dp2 with a held-out split of pairs, and tp2 with sequence parallelism x
ring cp2, equals one process (losses, validation, the pair metrics, every saved weight);
CogVideoX's Diffusion-DPO starts at ln 2 too; what Diffusion-DPO cannot mean is refused before
launch."""

import math

import numpy as np
import pytest
from helpers.mm_train_cli import parameter_errors, parameters, rows_of, val_losses
from helpers.train_runs import train

from mm_train.preflight import check_before_launch
from mm_train.recipe import load_recipe

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "errors/chosen", "errors/rejected",
           "errors/ref_chosen", "errors/ref_rejected")


def _run(run_distributed, out, *extra, data, recipe="wan2_1_t2v_tiny_dpo", nproc=1):
    train(run_distributed, recipe, "--set", f"data.path={data}", "--set", "data.samples=16", "--set",
          f"output_dir={out}", "--no-progress", *extra, nproc=nproc, data=out.parent / "unused")
    return rows_of(out)


def test_a_pairs_clips_share_their_noise_and_timestep(tmp_path):
    from mm_parallel import ParallelConfig
    from mm_parallel.topology import Topology
    from mm_train.families.video.data import WanTrainData

    recipe = load_recipe("wan2_1_t2v_tiny_dpo", [f"data.path={tmp_path / 'clips'}", "data.samples=8",
                                                 f"output_dir={tmp_path / 'out'}"])
    data = WanTrainData(recipe, Topology.build(ParallelConfig(), 1, 0), i2v=False)
    pairs = [data.dataset.get(i) for i in range(2)]
    batch = {k: np.stack([p[k] for p in pairs]) for k in pairs[0]}
    inputs = data.prepare(7, [batch])[0]
    assert inputs["clip_pairs"] == 2 and inputs["hidden_states"].shape[0] == 4
    s = inputs["timestep"] / recipe.section("diffusion").num_train_timesteps  # flow matching's sigma
    noise = inputs["hidden_states"] + (1 - s)[:, None, None, None, None] * inputs["target"]  # x_t + (1 - s) v
    for p in range(2):
        assert inputs["timestep"][p] == inputs["timestep"][2 + p]
        np.testing.assert_allclose(noise[p], noise[2 + p], atol=1e-5)
        assert not np.allclose(inputs["target"][p], inputs["target"][2 + p])  # two clips, one draw


def test_wan_diffusion_dpo_under_layouts_equals_one_process(tmp_path, run_distributed):
    data = tmp_path / "clips"
    # beta 50, not the recipe's 2500: the loss's logit is beta times a difference of errors that
    # another summation order rounds by ~1e-7, and 2500 x that is 1e-4 of the loss (measured)
    short = ["--set", "train.steps=3", "--set", "checkpoint.every=3", "--set", "eval.every=3", "--set",
             "eval.fraction=0.25", "--set", "train.global_batch_size=4", "--set", "train.micro_batch_size=1",
             "--set", "dpo.beta=50", "--set", "optim.lr=1e-4",
             "--set", "model.lora.r=4", "--set", "dpo.reference=adapters_off"]  # LoRA: the base is the reference
    single = _run(run_distributed, tmp_path / "single", *short, data=data)
    assert single[0]["loss"] == pytest.approx(math.log(2.0), rel=1e-6)
    for side in ("chosen", "rejected"):
        assert single[0][f"errors/{side}"] == pytest.approx(single[0][f"errors/ref_{side}"], rel=1e-6)
    layouts = {"pp2_dp2": ["--set", "parallel.pp=2"],
               "tp2_sp_ring_cp2": ["--set", "parallel.tp=2", "--set", "parallel.sequence_parallel=true", "--set",
                                   "parallel.cp=2", "--set", "parallel.cp_algo=ring"]}
    for name, extra in layouts.items():
        rows = _run(run_distributed, tmp_path / name, *short, *extra, data=data, nproc=4)
        for got, want in zip(rows, single):
            for key in ("loss",) + METRICS:
                # rewards are beta x a difference of errors of ~1.5 summed in another order (rounding ~1e-6 of them)
                tolerance = 2e-4 if key.startswith("rewards/") else 1e-5
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=tolerance), (name, got["step"], key)
        assert val_losses(tmp_path / name) == pytest.approx(val_losses(tmp_path / "single"), rel=1e-4), name
        adapters = "checkpoints/step_3/adapters"  # what trains (PEFT's adapter_model.safetensors)
        errors = parameter_errors(parameters(tmp_path / name, adapters), parameters(tmp_path / "single", adapters))
        assert max(errors.values()) <= 1e-4, (name, sorted(errors.items(), key=lambda kv: -kv[1])[:3])


def test_cogvideox_diffusion_dpo_starts_at_ln2(tmp_path):
    rows = _run(None, tmp_path / "run", "--set", "train.objective=dpo", "--set", "train.steps=1", "--set",
                "data.caption_dropout=0", data=tmp_path / "clips", recipe="cogvideox_t2v_tiny")
    assert rows[0]["loss"] == pytest.approx(math.log(2.0), rel=1e-6)
    assert rows[0]["errors/chosen"] == pytest.approx(rows[0]["errors/ref_chosen"], rel=1e-6)


def test_what_diffusion_dpo_cannot_mean_is_refused_before_launch(tmp_path):
    for overrides, match in [(["dpo.method=ipo"], "sigmoid form alone"), (["dpo.sft_weight=0.5"], "sigmoid form"),
                             (["data.online=true"], "set data.online false"),
                             (["dpo.reference=cached"], "drawn anew every step")]:
        recipe = load_recipe("wan2_1_t2v_tiny_dpo", overrides + [f"output_dir={tmp_path}"])
        with pytest.raises(ValueError, match=match):
            check_before_launch(recipe)
