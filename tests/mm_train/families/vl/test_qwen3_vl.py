"""The built-in Qwen3-VL recipes train through `mm-train run NAME` (loss falls on the generated
pictures), the MoE one logs its routing, trains under ep2 and sequence-parallel tp2 as one
process and resumes across layouts; the saved model folder loads in transformers."""

import json

import pytest
from helpers.train_runs import train

pytestmark = pytest.mark.distributed


def rows(out):
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def test_qwen3_vl_recipes_train_and_moe_layouts_equal_one_process(tmp_path, run_distributed):
    """The MoE runs under ep2, tp2+sp and ep2 x dp2 with ZeRO-3 (experts cut over expert-dp) stop
    at step 2 and resume (on one process, under ep2) to step 4: every loss equals the
    uninterrupted single-process run's."""
    import transformers

    short = ["--set", "data.samples=32", "--no-progress"]
    ep2 = ["--set", "parallel.ep=2"]
    tp2_sp = ["--set", "parallel.tp=2", "--set", "parallel.sequence_parallel=true"]
    zero3 = ["--set", "parallel.zero_stage=3", "--set", "parallel.zero3_min_numel=1024"]  # experts cut over edp 2
    halves = ["--set", "train.steps=2", "--set", "checkpoint.every=2"]
    runs = {"dense": ("qwen3_vl_tiny", 1, ["--set", "train.steps=30", "--set", "checkpoint.every=30"]),
            "moe": ("qwen3_vl_moe_tiny", 1, ["--set", "train.steps=4"]),
            "moe_ep2": ("qwen3_vl_moe_tiny", 2, ep2 + halves),
            "moe_tp2_sp": ("qwen3_vl_moe_tiny", 2, tp2_sp + halves),
            "moe_ep2_dp2_zero3": ("qwen3_vl_moe_tiny", 4, ep2 + zero3 + halves + ["--set", "train.micro_batch_size=2"])}
    # (processes, layout) of the resumed half
    resumes = {"moe_ep2": (1, []), "moe_tp2_sp": (2, ep2), "moe_ep2_dp2_zero3": (1, [])}
    got = {}
    for name, (recipe, nproc, extra) in runs.items():
        out, data = tmp_path / name, tmp_path / "data"
        train(run_distributed, recipe, *short, *extra, "--set", f"output_dir={out}", nproc=nproc, data=data)
        if name in resumes:
            nproc, extra = resumes[name]
            train(run_distributed, recipe, *short, "--set", "train.steps=4", "--resume", *extra,
                  "--set", f"output_dir={out}", nproc=nproc, data=data)
        got[name] = rows(out)
    dense = [row["loss"] for row in got["dense"]]
    assert dense[-1] < 0.5 * dense[0], dense
    assert sorted(got["moe"][-1]["moe"]) == ["model.language_model.layers.0.mlp", "model.language_model.layers.1.mlp"]
    single = [row["loss"] for row in got["moe"]]
    for name in resumes:
        assert [row["loss"] for row in got[name]] == pytest.approx(single, rel=1e-4), name
    saved = tmp_path / "dense" / "checkpoints" / "step_30" / "model"
    transformers.Qwen3VLForConditionalGeneration.from_pretrained(str(saved))
