"""Running built-in recipes as a user does, for the benchmarks that measure what they learn
(dpo_figures.py, grpo_figures.py): `mm-train run` in a subprocess, its metrics read back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List


def mm_train() -> str:
    return shutil.which("mm-train", path=os.path.dirname(sys.executable)) or "mm-train"


def run(recipe: str, out: Path, data: Path, *sets: str, nproc: int = 1) -> float:
    """`mm-train run RECIPE --set output_dir=OUT --set ...` (``--nproc`` when > 1) with
    MM_TRAIN_DATA=data; its seconds (a failed run ends the benchmark with its stderr)."""
    began = time.perf_counter()
    args = [mm_train(), "run", recipe, "--no-progress", "--set", f"output_dir={out}"]
    for value in sets:
        args += ["--set", value]
    args += ["--nproc", str(nproc)] if nproc > 1 else []
    done = subprocess.run(args, env={**os.environ, "MM_TRAIN_DATA": str(data)}, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - began


def rows(out: Path) -> List[Dict]:
    """A run's metrics.jsonl rows."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def mean(rows, key) -> float:
    return sum(r[key] for r in rows) / len(rows)
