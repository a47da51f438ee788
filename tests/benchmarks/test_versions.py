"""benchmarks/versions.py: its probe reads this environment (releases, the Ascend path's MindSpore
calls, the default run's losses), and its table sets environments side by side, naming a changed
signature and the losses' difference."""

import json
import subprocess
import sys
from pathlib import Path

import mindspore

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import versions  # noqa: E402


def test_the_probe_reads_this_environment_and_the_table_compares_two():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "versions.py"), "--probe", "--steps", "2"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT / "benchmarks")
    assert out.returncode == 0, out.stderr[-3000:]
    here = json.loads(out.stdout)
    assert here["mindspore"] == mindspore.__version__ and here["warned"] == []
    assert all(here["calls"][call] for call in versions.CALLS), here["calls"]
    assert len(here["default_losses"]) == 2 and here["gemm_gflops"] > 0
    figures = {"qwen2_5_vl_ratio": 1.2, "wan_ratio": 1.1, "qwen2_5_vl_loss": 11.5, "wan_loss": 1.7,
               "jit_speedup": 1.3, "jit_error": 9.0}
    other = {**here, **figures, "mindspore": "9.9.9", "default_losses": [x * 1.01 for x in here["default_losses"]],
             "calls": {**here["calls"], versions.CALLS[0]: "(query)", versions.CALLS[1]: None}}
    text = versions.table([{**here, **figures}, other])
    assert "9.9.9" in text and "changed: (query)" in text and "missing" in text
    row = next(line for line in text.splitlines() if line.startswith("default run losses"))
    assert row.split()[-2:] == ["0.0e+00", "1.0e-02"], row
