"""Padding-free VL training (data.packing): a rank's samples packed into rows under a token budget
train exactly like the same samples unpacked with the per-token loss (train.loss_normalization
token, Megatron's): losses step by step rel 1e-5 and every parameter after 3 steps rel 1e-4 on
one process; under dp2 x pp2 with ZeRO-1 (data-parallel ranks with different numbers of rows),
tp2 with sequence parallelism and ring cp2 together, Ulysses cp2, and dp2 x pp2 with ZeRO-3 and
full recomputation (weights gathered again inside the recomputed forward) the packed run equals
the single process too."""

import os

import pytest
from helpers.mm_train_cli import losses, parameter_errors, parameters, rows_of
from helpers.train_runs import train

SHORT = ["--set", "train.steps=3", "--set", "data.samples=32", "--set", "checkpoint.every=3", "--no-progress"]
PACKED = ["--set", "data.packing=true", "--set", "data.max_tokens=96"]


def mixed_set(root) -> list:
    """--set arguments of a LLaMA-Factory set of 16 samples, every other one with a 56 x 56
    picture (and a longer answer), the rest text only."""
    import json
    from pathlib import Path

    from helpers.media import write_image

    from mm_train.families.tiny_sets import train_tokenizer
    from mm_train.families.vl.tiny import SPECIAL

    root.mkdir()
    for i in range(4):
        write_image(str(root / f"img{i}.png"), 56, 56, seed=i)
    entries = []
    for i in range(16):
        picture = i % 2 == 0
        entries.append({"messages": [{"role": "user", "content": ("<image>" if picture else "") + "What is it?"},
                                     {"role": "assistant", "content": "A square." if picture else "Words."}],
                        **({"images": [f"img{i % 4}.png"]} if picture else {})})
    (root / "sft.json").write_text(json.dumps(entries))
    train_tokenizer(["What is it?", "A square.", "Words.", "user\n", "assistant\n"], Path(root / "tokenizer.json"),
                    SPECIAL)
    return ["--set", "data.kind=llamafactory", "--set", f"data.path={root / 'sft.json'}", "--set",
            f"data.tokenizer={root / 'tokenizer.json'}", "--set", "data.min_pixels=3136", "--set",
            "data.max_pixels=3136"]


def test_packed_rows_train_like_the_samples_unpacked_on_every_layout(tmp_path, run_distributed):
    data = tmp_path / "data"
    train(run_distributed, *SHORT, "--set", "data.packing=false", "--set", "train.loss_normalization=token", "--set",
          f"output_dir={tmp_path / 'plain'}", data=data)
    runs = {"packed": (1, []), "dp2_pp2_zero1": (4, ["--set", "parallel.pp=2", "--set", "parallel.zero_stage=1"]),
            "tp2_sp_ring_cp2": (4, ["--set", "parallel.tp=2", "--set", "parallel.sequence_parallel=true", "--set",
                                    "parallel.cp=2", "--set", "parallel.cp_algo=ring"]),
            "ulysses_cp2": (2, ["--set", "parallel.cp=2"]),
            "dp2_pp2_zero3_recompute": (4, ["--set", "parallel.pp=2", "--set", "parallel.zero_stage=3", "--set",
                                            "parallel.zero3_min_numel=1024", "--set", "model.recompute=full"])}
    plain, expected = losses(tmp_path / "plain"), parameters(tmp_path / "plain")
    for name, (nproc, extra) in runs.items():
        train(run_distributed, *SHORT, *PACKED, *extra, "--set", f"output_dir={tmp_path / name}", nproc=nproc,
              data=data)
        assert losses(tmp_path / name) == pytest.approx(plain, rel=1e-5), name
        errors = parameter_errors(parameters(tmp_path / name), expected)
        assert max(errors.values()) <= 1e-4, (name, sorted(errors.items(), key=lambda kv: -kv[1])[:3])
        rows = rows_of(tmp_path / name)  # the rows say how full the rows were and how even the ranks
        assert all(0 <= row["padding_fraction"] < 0.2 and row["tokens_max_over_mean"] >= 1 for row in rows), rows
        if not name.startswith("dp2"):
            assert all(row["tokens_max_over_mean"] == 1 for row in rows)
    assert "padding_fraction" not in rows_of(tmp_path / "plain")[0]


@pytest.mark.parametrize("recipe", ["qwen3_vl_tiny", "qwen2_5_omni_tiny"])
def test_the_other_vl_families_pack_like_one_process_under_dp2_and_tp2_with_sp(tmp_path, run_distributed, recipe):
    """Qwen3-VL (DeepStack, timestamps) and the Omni thinker (audio, TMRoPE): packed under dp2 x tp2
    with sequence parallelism equals the same samples unpacked on one process."""
    data = tmp_path / "data"
    train(run_distributed, recipe, *SHORT, "--set", "data.packing=false", "--set", "train.loss_normalization=token",
          "--set", f"output_dir={tmp_path / 'plain'}", data=data)
    train(run_distributed, recipe, *SHORT, "--set", "data.packing=true", "--set", "data.max_tokens=160", "--set",
          "parallel.tp=2", "--set", "parallel.sequence_parallel=true", "--set", f"output_dir={tmp_path / 'packed'}",
          nproc=4, data=data)
    assert losses(tmp_path / "packed") == pytest.approx(losses(tmp_path / "plain"), rel=1e-5)
    errors = parameter_errors(parameters(tmp_path / "packed"), parameters(tmp_path / "plain"))
    assert max(errors.values()) <= 1e-4, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


def test_ranks_whose_micro_batches_hold_no_image_neither_hang_nor_drift(tmp_path, run_distributed):
    """Half of the samples text-only, one sample per micro-batch (unpacked) while the vision tower
    trains: under dp2, pp2 and tp2 some ranks and stages run micro-batches (whole steps, on some
    ranks) with no picture; every layout equals one process, packed (rows) too."""
    data = mixed_set(tmp_path / "mixed") + ["--set", "train.global_batch_size=4", "--set", "train.micro_batch_size=1"]
    unpacked = ["--set", "data.packing=false", "--set", "train.loss_normalization=token"]
    train(run_distributed, *SHORT, *data, *unpacked, "--set", f"output_dir={tmp_path / 'single'}", data=tmp_path)
    expected, curve = parameters(tmp_path / "single"), losses(tmp_path / "single")
    runs = {"dp2": (2, unpacked), "pp2": (2, unpacked + ["--set", "parallel.pp=2"]),
            "tp2": (2, unpacked + ["--set", "parallel.tp=2"]), "packed_dp2": (2, [])}
    for name, (nproc, extra) in runs.items():
        train(run_distributed, *SHORT, *data, *extra, "--set", f"output_dir={tmp_path / name}", nproc=nproc,
              data=tmp_path)
        assert losses(tmp_path / name) == pytest.approx(curve, rel=1e-5), name
        got = parameters(tmp_path / name)
        errors = parameter_errors(got, expected)
        assert max(errors.values()) <= 1e-4, (name, sorted(errors.items(), key=lambda kv: -kv[1])[:3])
        assert any(key.startswith("visual.") or ".visual." in key for key in got)  # the tower trained and saved


def test_steps_of_a_token_budget_resume_exactly_under_another_layout(tmp_path, run_distributed):
    """train.global_batch_tokens: each step takes as many samples as the budget holds (their
    number, batch_samples, varies with the samples' lengths); the data position is a function of
    the step, so a run of 4 steps on one process equals 2 steps under dp2 resumed for 2 more on
    one process — losses step by step and every parameter at the end."""
    budget = ["--set", "train.global_batch_tokens=64", *mixed_set(tmp_path / "mixed"), "--set", "checkpoint.every=2",
              *PACKED, "--no-progress"]
    train(run_distributed, *budget, "--set", "train.steps=4", "--set", f"output_dir={tmp_path / 'whole'}",
          data=tmp_path)
    train(run_distributed, *budget, "--set", "train.steps=2", "--set", f"output_dir={tmp_path / 'split'}", nproc=2,
          data=tmp_path)
    train(run_distributed, *budget, "--set", "train.steps=4", "--set", f"output_dir={tmp_path / 'split'}", "--resume",
          data=tmp_path)
    whole = rows_of(tmp_path / "whole")
    assert len({row["batch_samples"] for row in whole}) > 1, whole  # the budget, not a count, sets a step's samples
    assert losses(tmp_path / "split") == pytest.approx(losses(tmp_path / "whole"), rel=1e-5)
    folder = os.path.join("checkpoints", "step_4", "model")
    errors = parameter_errors(parameters(tmp_path / "split", folder), parameters(tmp_path / "whole", folder))
    assert max(errors.values()) <= 1e-4, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


def test_shards_converted_from_the_json_train_like_it_under_dp2(tmp_path, run_distributed):
    """`mm-data convert` of a LLaMA-Factory set to Parquet (media embedded, blocks of 2 rows) and to
    WebDataset tars: with each step the whole set (16 samples: the shards' block order and the
    JSON's shuffle hold the same samples) and the per-token loss, a run on Parquet shards and one
    on the tars under dp2 give the JSON run's losses (rel 1e-5)."""
    from mm_data.cli import main as mm_data

    data = mixed_set(tmp_path / "mixed")
    source = data[data.index("--set") + 3].split("=", 1)[1]
    for fmt in ("parquet", "webdataset"):
        assert mm_data(["convert", source, str(tmp_path / fmt), "--format", fmt, "--rows-per-shard", "8",
                        "--rows-per-block", "2"]) == 0
    whole = ["--set", "train.steps=2", "--set", "train.global_batch_size=16", "--set", "train.micro_batch_size=4",
             *PACKED, "--set", "train.loss_normalization=token", "--no-progress", *data]
    train(run_distributed, *whole, "--set", f"output_dir={tmp_path / 'json'}", data=tmp_path)
    for fmt, nproc in (("parquet", 1), ("webdataset", 2)):
        train(run_distributed, *whole, "--set", f"data.format={fmt}", "--set", f"data.path={tmp_path / fmt}",
              "--set", f"output_dir={tmp_path / fmt}-run", nproc=nproc, data=tmp_path)
        assert losses(tmp_path / f"{fmt}-run") == pytest.approx(losses(tmp_path / "json"), rel=1e-5), fmt
