"""train.objective dpo on the tiny Qwen2.5-VL (mm_train.preference_step): pairs of the built-in
pictures (data.kind tiny_vl_pairs). The first step's loss is the objective's value at pi = pi_ref
(ln 2, (1 / (2 beta))^2, 1); under LoRA the base model with its adapters switched off is the same
reference as a frozen copy, and so is a cache of the starting model's log-probs (also resumed);
pairs packed into rows train like the same pairs in padded rows; dp2 x pp2 x vpp2 with ZeRO-1 and
the reference cached (stopped at step 2, resumed on one process) and tp2 with sequence parallelism
and ring cp2 equal one process — losses, the pair metrics and every parameter; Qwen3-VL-MoE's DPO
under ep2 x dp2 with ZeRO-3 (experts sliced over expert-dp) and full recomputation too; recipes
that cannot mean DPO are refused before launch; bf16 starts at ln 2 and resumes exactly."""

import math

import pytest
from helpers.mm_train_cli import parameter_errors, parameters, rows_of
from helpers.train_runs import train

from mm_train.recipe import load_recipe

DPO = ["qwen2_5_vl_tiny_dpo", "--set", "data.samples=32", "--no-progress"]
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected", "logps/ref_chosen", "logps/ref_rejected")


@pytest.mark.parametrize("method, beta, start", [("sigmoid", 0.1, math.log(2.0)), ("ipo", 0.5, 1.0),
                                                 ("hinge", 0.1, 1.0)])
def test_the_first_step_starts_at_the_objectives_value(tmp_path, method, beta, start):
    train(None, *DPO, "--set", "train.steps=1", "--set", f"dpo.method={method}", "--set", f"dpo.beta={beta}",
          "--set", f"output_dir={tmp_path / 'run'}", data=tmp_path / "data")
    row = rows_of(tmp_path / "run")[0]
    assert row["loss"] == pytest.approx(start, rel=1e-6)
    for side in ("chosen", "rejected"):  # pi = pi_ref: no reward yet, the reference's log-probs the policy's
        assert row[f"rewards/{side}"] == pytest.approx(0.0, abs=1e-5)
        assert row[f"logps/{side}"] == pytest.approx(row[f"logps/ref_{side}"], rel=1e-6) and row[f"logps/{side}"] < 0


def test_adapters_switched_off_are_the_reference_a_frozen_copy_is(tmp_path):
    runs = {}
    for reference in ("copy", "adapters_off"):
        out = tmp_path / reference
        train(None, *DPO, "--set", "train.steps=3", "--set", "model.lora.r=4", "--set", "optim.lr=0.02", "--set",
              f"dpo.reference={reference}", "--set", f"output_dir={out}", data=tmp_path / "data")
        runs[reference] = rows_of(out)
    for copy, off in zip(runs["copy"], runs["adapters_off"]):
        for key in ("loss",) + METRICS:
            assert off[key] == pytest.approx(copy[key], rel=1e-5, abs=1e-7), key
    assert runs["copy"][-1]["logps/chosen"] != pytest.approx(runs["copy"][-1]["logps/ref_chosen"], rel=1e-4)


def test_a_cached_reference_trains_like_a_frozen_copy_and_resumes(tmp_path):
    """dpo.reference cached: the starting model's log-probs of every pair, computed before step 1
    into OUT/reference_logps.safetensors, give the losses and metrics a frozen copy gives; a run
    stopped at step 2 resumes from the file to the uninterrupted run's step 3."""
    short = [*DPO, "--set", "train.steps=3", "--set", "optim.lr=0.003", "--set", "data.packing=false",
             "--set", "eval.every=3", "--set", "eval.fraction=0.25"]
    runs = {}
    for reference in ("copy", "cached"):
        train(None, *short, "--set", f"dpo.reference={reference}", "--set", f"output_dir={tmp_path / reference}",
              data=tmp_path / "data")
        runs[reference] = rows_of(tmp_path / reference)
    assert (tmp_path / "cached" / "reference_logps.safetensors").is_file()
    for copy, cached in zip(runs["copy"], runs["cached"]):
        for key in ("loss", "val_loss") + METRICS:
            if key in copy and not (key == "rewards/accuracies" and copy["step"] == 1):  # step 1: ties of noise
                tolerance = 1e-4 if key.startswith("rewards/") else 1e-6
                assert cached[key] == pytest.approx(copy[key], rel=1e-5, abs=tolerance), (copy["step"], key)
    out = tmp_path / "resumed"
    train(None, *short, "--set", "dpo.reference=cached", "--set", "train.steps=2", "--set", "checkpoint.every=2",
          "--set", f"output_dir={out}", data=tmp_path / "data")
    train(None, *short, "--set", "dpo.reference=cached", "--set", "checkpoint.every=2", "--set", f"output_dir={out}",
          "--resume", data=tmp_path / "data")
    assert [r["loss"] for r in rows_of(out)] == pytest.approx([r["loss"] for r in runs["cached"]], rel=1e-6)


def test_bf16_dpo_starts_at_ln2_and_resumes_exactly(tmp_path):
    """In bf16 the policy and its frozen copy compute the same log-probs at step 1 (ln 2 as in
    fp32), and a run stopped at step 2 resumes to the uninterrupted run's losses."""
    short = [*DPO, "--set", "train.precision=bf16", "--set", "train.steps=3", "--set", "optim.lr=0.003"]
    train(None, *short, "--set", f"output_dir={tmp_path / 'whole'}", data=tmp_path / "data")
    whole = rows_of(tmp_path / "whole")
    assert whole[0]["loss"] == pytest.approx(math.log(2.0), rel=1e-6)
    out = tmp_path / "resumed"
    train(None, *short, "--set", "train.steps=2", "--set", "checkpoint.every=2", "--set", f"output_dir={out}",
          data=tmp_path / "data")
    train(None, *short, "--set", "checkpoint.every=2", "--set", f"output_dir={out}", "--resume", data=tmp_path / "data")
    # not to the bit: the CPU kernels' summation order moves step 1's log-probs by an ulp from run to
    # run (measured), and Adam's normalised steps on DPO's near-zero first gradients grow it to ~5e-5
    assert [r["loss"] for r in rows_of(out)] == pytest.approx([r["loss"] for r in whole], rel=1e-4)


def test_dpo_recipes_are_checked_before_launch():
    for overrides, match in [
        (["train.objective=sft"], "the dpo section sets the dpo objective"),
        (["dpo.reference=adapters_off"], "model.lora is not set"),
        (["dpo.reference=cached", "eval.path=/data/held_out.json"], "eval.path's pairs are not among them"),
        (["train.loss_normalization=token"], "averages over the global batch's pairs"),
        (["dpo.method=orpo"], "dpo.method='orpo' is unknown"),
        (["train.objective=grpo"], "the dpo section sets the dpo objective, and train.objective is grpo"),
    ]:
        with pytest.raises(ValueError, match=match):
            load_recipe("qwen2_5_vl_tiny_dpo", overrides)
    with pytest.raises(ValueError, match="is not one family wan trains"):
        load_recipe("wan2_1_t2v_tiny", ["train.objective=sft"])


def test_dpo_under_every_layout_equals_one_process(tmp_path, run_distributed):
    data = tmp_path / "data"
    short = [*DPO, "--set", "train.steps=3", "--set", "checkpoint.every=2", "--set", "optim.lr=0.003", "--set",
             "model.config.text_config.num_hidden_layers=4"]  # 4 layers: two virtual stages of two stages
    train(run_distributed, *short, "--set", "data.packing=false", "--set", f"output_dir={tmp_path / 'plain'}",
          data=data)
    plain, expected = rows_of(tmp_path / "plain"), parameters(tmp_path / "plain")
    runs = {"packed": (1, []),
            "dp2_pp2_vpp2_zero1_cached": (4, ["--set", "parallel.pp=2", "--set", "parallel.vpp=2", "--set",
                                              "parallel.zero_stage=1", "--set", "train.steps=2", "--set",
                                              "dpo.reference=cached", "--set", "train.micro_batch_size=2"]),
            "tp2_sp_ring_cp2": (4, ["--set", "parallel.tp=2", "--set", "parallel.sequence_parallel=true", "--set",
                                    "parallel.cp=2", "--set", "parallel.cp_algo=ring"])}
    for name, (nproc, extra) in runs.items():
        train(run_distributed, *short, *extra, "--set", f"output_dir={tmp_path / name}", nproc=nproc, data=data)
    # the pp run (its reference cached before step 1, gathered from the stages) stopped at step 2:
    # resumed on one process, which reads the cache back
    train(run_distributed, *short, "--set", "dpo.reference=cached", "--set",
          f"output_dir={tmp_path / 'dp2_pp2_vpp2_zero1_cached'}", "--resume", data=data)
    for name in runs:
        rows = rows_of(tmp_path / name)
        assert [r["step"] for r in rows] == [1, 2, 3], name
        for got, want in zip(rows, plain):
            for key in ("loss",) + METRICS:
                if key == "rewards/accuracies" and got["step"] == 1:
                    continue  # pi = pi_ref: the rewards are rounding noise, which side wins is a coin toss
                # rewards: beta times a difference of log-probs of ~ -60, whose rounding is ~1e-5 of them
                tolerance = 1e-4 if key.startswith("rewards/") else 1e-6
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=tolerance), (name, got["step"], key)
        errors = parameter_errors(parameters(tmp_path / name), expected)
        assert max(errors.values()) <= 1e-4, (name, sorted(errors.items(), key=lambda kv: -kv[1])[:3])


def test_qwen3_vl_moe_dpo_under_ep2_zero3_equals_one_process(tmp_path, run_distributed):
    """The DPO objective plugs into Qwen3-VL-MoE (DeepStack, routed experts, the load-balancing
    loss) as into Qwen2.5-VL: ep2 x dp2 with ZeRO-3 (the experts sliced over expert-dp) and full
    recomputation (weights gathered again in the backward) equals one process."""
    data = tmp_path / "data"
    short = ["qwen3_vl_moe_tiny", "--set", "train.objective=dpo", "--set", "data.kind=tiny_vl_pairs", "--set",
             "data.samples=32", "--set", "train.steps=3", "--set", "checkpoint.every=3", "--set", "optim.lr=3e-4",
             "--no-progress"]
    train(run_distributed, *short, "--set", f"output_dir={tmp_path / 'single'}", data=data)
    train(run_distributed, *short, "--set", "parallel.ep=2", "--set", "parallel.zero_stage=3", "--set",
          "parallel.zero3_min_numel=256", "--set", "model.recompute=full", "--set", f"output_dir={tmp_path / 'layout'}",
          nproc=2, data=data)
    single, layout = rows_of(tmp_path / "single"), rows_of(tmp_path / "layout")
    # above ln 2 by the load-balancing loss the MoE model adds (as TRL's DPOTrainer adds aux_loss)
    assert single[0]["loss"] > math.log(2.0)
    for got, want in zip(layout, single):  # rel 1e-4 as the MoE SFT layouts (test_qwen3_vl.py): the router's
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)  # statistics summed in another order
        assert got["logps/chosen"] == pytest.approx(want["logps/chosen"], rel=1e-5)
    # the experts (sliced over expert-dp): Adam turns DPO's near-zero first gradients into full steps,
    # so weights that start at zero (biases) differ by rounding-sized values; the experts do not
    errors = parameter_errors(parameters(tmp_path / "layout"), parameters(tmp_path / "single"))
    experts = {k: v for k, v in errors.items() if ".experts." in k}
    assert experts and max(experts.values()) <= 1e-3, sorted(experts.items(), key=lambda kv: -kv[1])[:3]
