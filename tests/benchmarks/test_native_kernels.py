"""benchmarks/native_kernels.py runs end to end on small tensors and prints every kernel's row."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_native_kernels_benchmark_runs():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "native_kernels.py"), "--shape", "256", "256",
                             "--runs", "1"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith(("gelu", "swiglu", "layer-norm", "rms"))]
    assert len(rows) == 4, result.stdout
    assert all(float(row.split()[-1]) < 1e-4 for row in rows), result.stdout  # native equals written-out
