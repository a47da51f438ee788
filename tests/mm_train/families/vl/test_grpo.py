"""train.objective grpo on the tiny Qwen2.5-VL (mm_train.grpo_step): the colour question on the
built-in pictures (data.kind tiny_vl_colours), rollouts decoded in place under the training layout.

A random tiny model's completions are scored by a format reward that tells short answers from
long ones (so groups have advantages to learn from), with the KL term to a frozen copy and two
optimizer steps per generation (the sampling policy's log-probs taken before the first). Padded
rows on one process, packed rows under pp2 x dp2 and dp2 with ZeRO-3 (forward passes together
across dp while decoding and training; stopped at a generation's end and resumed) give the same
losses, rewards, KL, clip ratios and parameters, and so does Qwen3-VL-MoE under ep2 x dp2 with
ZeRO-3; recipes that cannot mean GRPO are refused before launch."""

import os

import pytest
from helpers.mm_train_cli import parameter_errors, parameters, rows_of
from helpers.train_runs import train

from mm_train.recipe import load_recipe

GRPO = ["qwen2_5_vl_tiny_colours", "--set", "train.objective=grpo", "--set", "data.samples=32", "--set",
        "grpo.num_generations=4", "--set", "grpo.max_completion_length=6", "--set", "grpo.rewards={format: 1.0}",
        "--set", "grpo.format_pattern=^.{0,9}$", "--set", "grpo.beta=0.05", "--set", "grpo.num_iterations=2",
        "--set", "train.micro_batch_size=2", "--set", "optim.lr=0.003", "--set", "checkpoint.every=0",
        "--no-progress"]
FIGURES = ("loss", "reward", "reward_std", "reward/format", "kl", "clip_ratio", "completion_length")


def _same_run(got, want, name):
    assert [r["step"] for r in got] == [r["step"] for r in want], name
    for g, w in zip(got, want):
        for key in FIGURES:
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-6), (name, g["step"], key)


def test_grpo_under_every_layout_equals_one_process_and_resumes(tmp_path, run_distributed):
    """Padded rows on one process against packed rows under pp2 x dp2 and dp2 with ZeRO-3 (stopped
    at the first generation's end and resumed)."""
    data = tmp_path / "data"
    short = [*GRPO, "--set", "train.steps=4", "--set", "checkpoint.every=2"]
    final = os.path.join("checkpoints", "step_4", "model")
    picture = tmp_path / "data_colours" / "images" / "00000.png"  # the built-in set (MM_TRAIN_DATA + _colours)
    train(run_distributed, *short, "--set", "data.packing=false", "--set", f"output_dir={tmp_path / 'plain'}",
          "--set", "eval.sample_every=4", "--set", "eval.prompts=['<image>what colour is the background?']",
          "--set", f"eval.images=[{picture}]", data=data)
    plain, expected = rows_of(tmp_path / "plain"), parameters(tmp_path / "plain", final)
    page = (tmp_path / "plain" / "samples" / "step_4" / "completions.md").read_text()
    assert page.count("- reward ") == 4 * 4 and "what colour is the background?" in page  # 4 prompts x 4
    assert (tmp_path / "plain" / "samples" / "step_4" / "answers.md").is_file()
    assert 0 < plain[0]["reward"] < 1 and plain[0]["reward_std"] > 0  # the groups have advantages
    assert plain[0]["kl"] == pytest.approx(0.0, abs=1e-6) and plain[-1]["kl"] > 1e-6  # the copy is the start
    zero3 = ["--set", "parallel.zero_stage=3", "--set", "parallel.zero3_min_numel=256"]
    # tp2 + sp and ring cp2: the update in tests/mm_models_vl/test_qwen2_5_vl_parallel.py (GRPO), the
    # rollouts in its decoding cases
    runs = {"pp2_dp2_packed": (4, ["--set", "parallel.pp=2"]), "dp2_zero3": (2, zero3 + ["--set", "train.steps=2"])}
    for name, (nproc, extra) in runs.items():
        train(run_distributed, *short, *extra, "--set", f"output_dir={tmp_path / name}", nproc=nproc, data=data)
    train(run_distributed, *short, *zero3, "--set", f"output_dir={tmp_path / 'dp2_zero3'}", "--resume", nproc=2,
          data=data)
    for name in runs:
        _same_run(rows_of(tmp_path / name), plain, name)
        errors = parameter_errors(parameters(tmp_path / name, final), expected)
        assert max(errors.values()) <= 1e-4, (name, sorted(errors.items(), key=lambda kv: -kv[1])[:3])


def test_grpo_recipes_are_checked_before_launch():
    base = ["train.objective=grpo"]
    for overrides, match in [
        (["grpo.num_generations=4"], "the grpo section sets the grpo objective"),
        (base + ["grpo.num_generations=1"], "num_generations must be an integer >= 2"),
        (base + ["grpo.beta=0.1", "grpo.reference=adapters_off"], "model.lora is not set"),
        (base + ["grpo.scale_rewards=rank"], "scale_rewards must be one of group, batch, none"),
        (base + ["grpo.rewards=[accuracy]"], "must map reward functions to weights"),
        (base + ["grpo.max_completion_length=64"], "raise data.max_length"),
        (base + ["eval.every=5", "eval.fraction=0.1"], "grpo has no validation loss"),
        (base + ["train.global_batch_tokens=512", "train.global_batch_size=null"], "rollouts decide"),
        (base + ["grpo.temperature=0"], "temperature must be > 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            load_recipe("qwen2_5_vl_tiny_colours", overrides)
    recipe = load_recipe("qwen2_5_vl_tiny_grpo")
    assert recipe.train.objective == "grpo" and "grpo" in recipe.to_dict() and "dpo" not in recipe.to_dict()


def test_qwen3_vl_moe_grpo_under_ep2_zero3_equals_one_process(tmp_path, run_distributed):
    """GRPO plugs into Qwen3-VL-MoE (DeepStack, routed experts, the load-balancing loss) as into
    Qwen2.5-VL: ep2 x dp2 with ZeRO-3 — the ranks exchange experts and gather weights in every
    decoding step and every forward, so they decode and train in step — equals one process."""
    data = tmp_path / "data"
    short = ["qwen3_vl_moe_tiny", "--set", "data.kind=tiny_vl_colours", "--set", "data.max_length=64", *GRPO[1:],
             "--set", "train.steps=2", "--set", "grpo.num_iterations=1", "--set", "checkpoint.every=2"]
    train(run_distributed, *short, "--set", f"output_dir={tmp_path / 'single'}", data=data)
    train(run_distributed, *short, "--set", "parallel.ep=2", "--set", "parallel.zero_stage=3", "--set",
          "parallel.zero3_min_numel=256", "--set", f"output_dir={tmp_path / 'layout'}", nproc=2, data=data)
    single = rows_of(tmp_path / "single")
    assert 0 < single[0]["reward"] < 1
    for got, want in zip(rows_of(tmp_path / "layout"), single):  # rel 1e-4 as the MoE SFT layouts: the router's
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-6)  # statistics summed in another order
        for key in ("reward", "kl", "completion_length"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    final = os.path.join("checkpoints", "step_2", "model")
    errors = parameter_errors(parameters(tmp_path / "layout", final), parameters(tmp_path / "single", final))
    experts = {k: v for k, v in errors.items() if ".experts." in k}
    assert experts and max(experts.values()) <= 1e-3, sorted(experts.items(), key=lambda kv: -kv[1])[:3]
