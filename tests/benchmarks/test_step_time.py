"""The train-step benchmarks run end to end at one timed step (Qwen2.5-VL with a small vocabulary,
Wan and CogVideoX with 512 video tokens instead of 2,048).
Each exits with an error when our first-step loss and the torch original's differ (same weights,
same inputs), so a broken benchmark or a broken model fails here."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch  # noqa: F401  (the parity reference: required, see tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("script, args", [
    ("step_time_qwen2_5_vl.py", ["--runs", "1", "--vocab", "2000"]),
    ("step_time_wan.py", ["--runs", "1", "--frames", "2"]),
    ("step_time_cogvideox.py", ["--runs", "1", "--frames", "2", "--no-bf16"]),
    ("step_time_qwen3_vl.py", ["--runs", "1", "--vocab", "2000", "--moe"]),
])
def test_step_time_benchmark_runs(script, args):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script)] + args, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ratio ours/torch" in result.stdout and "first-step loss" in result.stdout
    assert "ratio ours/floor" in result.stdout and "GFLOP/s at" in result.stdout
