"""The data benchmarks run end to end at small size (each asserts its outputs equal the reference)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script, args", [
    ("data_vl.py", ["--images", "3", "--videos", "1", "--frames", "4", "--runs", "1"]),
    ("data_video.py", ["--videos", "1", "--seconds", "3", "--clips", "3", "--runs", "1"]),
    ("data_audio.py", ["--clips", "2", "--max-seconds", "4", "--runs", "1"]),
])
def test_benchmark_runs(script, args):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script)] + args, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ratio" in result.stdout


def test_data_formats_benchmark_prints_each_format_side_by_side():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "data_formats.py"), "--samples", "24",
                             "--size", "64", "--runs", "1"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if "json" in line and "parquet" in line]
    assert len(rows) == 3 and all("webdataset" in row and "x)" in row for row in rows), result.stdout
