"""benchmarks/packing.py runs end to end on a small long-tailed set and prints each way's row and
the ratios; the packed rows keep under the budget with no padding."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_packing_benchmark_runs():
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "packing.py"), "--samples", "12",
                             "--max-tokens", "1024", "--runs", "1"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    rows = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines()
            if re.match(r"(fixed|padded|packed) +\d", line)}
    assert set(rows) == {"fixed", "padded", "packed"}, result.stdout
    assert rows["packed"][1] == "0.0%" and int(rows["packed"][0]) < int(rows["fixed"][0]), result.stdout
    assert len(re.findall(r"packed / \w+: [\d.]+x real tokens per second .*work saved: [\d.]+x positions, "
                          r"[\d.]+x attention scores", result.stdout)) == 2, result.stdout
