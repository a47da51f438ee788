"""Padding-free VL training (data.packing): a rank's samples packed into rows under a token budget
train exactly like the same samples unpacked with the per-token loss (train.loss_normalization
token, Megatron's): losses step by step rel 1e-5 and every parameter after 3 steps rel 1e-4 on
one process; under dp2 x pp2 with ZeRO-1 (data-parallel ranks with different numbers of rows),
tp2 with sequence parallelism and ring cp2 together, and Ulysses cp2 the packed run equals the
single process too."""

import os

import numpy as np
import pytest
from helpers.mm_train_cli import losses, rows_of
from helpers.train_runs import train

SHORT = ["--set", "train.steps=3", "--set", "data.samples=32", "--set", "checkpoint.every=3", "--no-progress"]
PACKED = ["--set", "data.packing=true", "--set", "data.max_tokens=96"]


def parameters(out):
    from safetensors.numpy import load_file

    folder = os.path.join(out, "checkpoints", "step_3", "model")
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
    return tensors


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def test_packed_rows_train_like_the_samples_unpacked_on_every_layout(tmp_path, run_distributed):
    data = tmp_path / "data"
    train(run_distributed, *SHORT, "--set", "data.packing=false", "--set", "train.loss_normalization=token", "--set",
          f"output_dir={tmp_path / 'plain'}", data=data)
    runs = {"packed": (1, []), "dp2_pp2_zero1": (4, ["--set", "parallel.pp=2", "--set", "parallel.zero_stage=1"]),
            "tp2_sp_ring_cp2": (4, ["--set", "parallel.tp=2", "--set", "parallel.sequence_parallel=true", "--set",
                                    "parallel.cp=2", "--set", "parallel.cp_algo=ring"]),
            "ulysses_cp2": (2, ["--set", "parallel.cp=2"])}
    plain, expected = losses(tmp_path / "plain"), parameters(tmp_path / "plain")
    for name, (nproc, extra) in runs.items():
        train(run_distributed, *SHORT, *PACKED, *extra, "--set", f"output_dir={tmp_path / name}", nproc=nproc,
              data=data)
        assert losses(tmp_path / name) == pytest.approx(plain, rel=1e-5), name
        got = parameters(tmp_path / name)
        assert set(got) == set(expected)
        errors = {key: rel(got[key], expected[key]) for key in expected}
        assert max(errors.values()) <= 1e-4, (name, sorted(errors.items(), key=lambda kv: -kv[1])[:3])
        rows = rows_of(tmp_path / name)  # the rows say how full the rows were and how even the ranks
        assert all(0 <= row["padding_fraction"] < 0.2 and row["tokens_max_over_mean"] >= 1 for row in rows), rows
        if name != "dp2_pp2_zero1":
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
    expected, got = parameters(tmp_path / "plain"), parameters(tmp_path / "packed")
    errors = {key: rel(got[key], expected[key]) for key in expected}
    assert set(got) == set(expected) and max(errors.values()) <= 1e-4, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
