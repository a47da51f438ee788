"""CogVideoX T2V pre-training with `mm-train run`: the tiny recipe (built-in clips encoded once by a
tiny CogVideoX VAE and T5 into a feature cache, v-prediction) learns, and gives the same losses
on one process and under DP2, TP2+SP, PP2 and CP2 (ring, over the joint text + video rows)."""

from pathlib import Path

import pytest
from test_run import losses
from train_runs import train

pytestmark = pytest.mark.distributed

RECIPE = str(Path(__file__).resolve().parents[2] / "packages/mm-train/src/mm_train/recipes/cogvideox_t2v_tiny.yaml")


def run(run_distributed, out, *extra, data, nproc=1):
    train(run_distributed, RECIPE, "--set", f"data.path={data}", "--set", f"output_dir={out}", "--no-progress",
          *extra, nproc=nproc, data=out.parent / "unused")
    return losses(out)


def test_tiny_cogvideox_learns_and_trains_alike_under_every_layout(tmp_path, run_distributed):
    data = tmp_path / "tiny_video"
    learned = run(run_distributed, tmp_path / "long", "--set", "train.steps=16", data=data)
    assert sum(learned[-4:]) < 0.9 * sum(learned[:4]), learned  # seeded: the same run every time
    assert (data / "features-cogvideox-t2v").is_dir()  # its own cache beside Wan's
    four = ["--set", "train.steps=4"]
    single = run(run_distributed, tmp_path / "single", *four, data=data)
    layouts = {"dp2": [], "tp2_sp": ["--set", "parallel.tp=2", "--set", "parallel.sequence_parallel=true"],
               "pp2": ["--set", "parallel.pp=2"],
               "cp2_ring": ["--set", "parallel.cp=2", "--set", "parallel.cp_algo=ring"]}
    for name, extra in layouts.items():
        got = run(run_distributed, tmp_path / name, *four, *extra, data=data, nproc=2)
        assert got == pytest.approx(single, rel=1e-4), (name, got, single)
