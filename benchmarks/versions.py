"""What differs between MindSpore (and transformers) releases, measured side by side: the APIs mm
calls, numerics, speed and ms.jit's shared written-backward gradient.

    python benchmarks/versions.py [--python PY ...] [--runs 3]

Each ``--python`` is an interpreter of an environment holding mm (editable) and one MindSpore
release (default: this one alone; docs/versions.md lists the environments measured). For each it
runs, in that interpreter:
- the probe (this script with ``--probe``): the releases installed, whether each MindSpore call
  of mm's Ascend path exists and its signature, MindSpore's fp32 matmul rate at 1024^3, and the
  built-in default trained 5 steps (its losses: the numerics of a whole run);
- benchmarks/step_time_qwen2_5_vl.py and step_time_wan.py: ours / torch step-time ratios (torch
  2.13 is the same in every environment, so the ratio compares MindSpore releases on a shared,
  noisy machine) and our first-step loss on the same weights and inputs;
- benchmarks/graph_mode.py: ms.jit's speed-up on a plain block and the gradient error of a Cell
  with a written backward called twice (the reason mm trains eagerly).
The table prints one column per environment; losses are also shown as the largest relative
difference from the first column's.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the MindSpore calls of mm's Ascend path (mm_parallel.ops) and of its runtime set-up
CALLS = ("mindspore.ops.flash_attention_score", "mindspore.ops.rms_norm", "mindspore.ops.rotary_position_embedding",
         "mindspore.ops.swiglu", "mindspore.ops.auto_generate.grouped_matmul", "mindspore.runtime.launch_blocking",
         "mindspore.runtime.dispatch_threads_num", "mindspore.communication.create_group")


def _resolve(dotted: str):
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name, None)
        return obj
    return None


def probe(steps: int) -> dict:
    """This environment's figures (run inside it)."""
    from importlib import metadata

    import mindspore
    import numpy
    from _timing import gemm_rate

    found = {}
    for dotted in CALLS:
        obj = _resolve(dotted)
        try:
            found[dotted] = str(inspect.signature(obj)) if obj is not None else None
        except (TypeError, ValueError):
            found[dotted] = "(signature not readable)"
    with tempfile.TemporaryDirectory() as out:
        run = subprocess.run([sys.executable, "-m", "mm_train.cli", "run", "--no-progress", "--set",
                              f"train.steps={steps}", "--set", f"output_dir={out}/run", "--set",
                              f"data.path={out}/data"], capture_output=True, text=True, timeout=900)
        if run.returncode != 0:
            raise SystemExit(f"the default run failed:\n{run.stderr[-3000:]}")
        losses = [json.loads(line)["loss"] for line in Path(out, "run", "metrics.jsonl").read_text().splitlines()]
    return {"mindspore": mindspore.__version__, "transformers": metadata.version("transformers"),
            "numpy": numpy.__version__, "calls": found, "gemm_gflops": gemm_rate((1024, 1024, 1024)) / 1e9,
            "default_losses": losses, "warned": [line for line in run.stderr.splitlines() if "untested" in line]}


def _script(python: str, name: str, *args: str) -> str:
    result = subprocess.run([python, str(HERE / name), *args], capture_output=True, text=True, timeout=1800,
                            cwd=HERE)
    if result.returncode != 0:
        raise SystemExit(f"{name} under {python} failed:\n{result.stderr[-3000:]}")
    return result.stdout


def _number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    return float(match.group(1)) if match else float("nan")


def measure(python: str, runs: int, steps: int) -> dict:
    figures = json.loads(subprocess.run([python, str(Path(__file__)), "--probe", "--steps", str(steps)],
                                        capture_output=True, text=True, check=True, cwd=HERE).stdout)
    for name, script in (("qwen2_5_vl", "step_time_qwen2_5_vl.py"), ("wan", "step_time_wan.py")):
        out = _script(python, script, "--runs", str(runs))
        figures[f"{name}_ratio"] = _number(r"ratio ours/torch: ([\d.]+)", out)
        figures[f"{name}_loss"] = _number(r"first-step loss: ours ([-\d.]+)", out)
    out = _script(python, "graph_mode.py", "--runs", "2", "--tokens", "1024")
    figures["jit_speedup"] = _number(r"speed-up on the plain block: ([\d.]+)x", out)
    figures["jit_error"] = _number(r"gradient error: ms.jit ([-\deE.+]+)", out)
    return figures


def table(columns: list) -> str:
    first = columns[0]

    def rel(a, b):
        return max(abs(x - y) / abs(y) for x, y in zip(a, b)) if len(a) == len(b) else float("nan")

    rows = [("MindSpore", lambda c: c["mindspore"]), ("transformers", lambda c: c["transformers"]),
            ("numpy", lambda c: c["numpy"]),
            ("fp32 matmul 1024^3 GFLOP/s", lambda c: f"{c['gemm_gflops']:.0f}"),
            ("Qwen2.5-VL step ours/torch", lambda c: f"{c['qwen2_5_vl_ratio']:.2f}"),
            ("Wan2.1 step ours/torch", lambda c: f"{c['wan_ratio']:.2f}"),
            ("Qwen2.5-VL first loss", lambda c: f"{c['qwen2_5_vl_loss']:.6f}"),
            ("Wan2.1 first loss", lambda c: f"{c['wan_loss']:.6f}"),
            ("default run losses, max rel. diff to col. 1",
             lambda c: f"{rel(c['default_losses'], first['default_losses']):.1e}"),
            ("default run loss first -> last",
             lambda c: f"{c['default_losses'][0]:.4f} -> {c['default_losses'][-1]:.4f}"),
            ("ms.jit speed-up, plain block", lambda c: f"{c['jit_speedup']:.2f}x"),
            ("ms.jit shared written-bprop error", lambda c: f"{c['jit_error']:.3g}"),
            ("untested-version line at start", lambda c: "yes" if c["warned"] else "no")]
    for call in CALLS:
        short = call.replace("mindspore.", "")
        rows.append((short, lambda c, call=call: "missing" if c["calls"][call] is None else
                     ("same" if c["calls"][call] == first["calls"][call] else "changed: " + c["calls"][call])))
    width = max(len(name) for name, _ in rows)
    lines = []
    for name, cell in rows:
        lines.append(f"{name:<{width}}  " + "  ".join(f"{cell(c):>18}" for c in columns))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", action="append", help="an environment's interpreter (repeat); default: this one")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="steps of the default run")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(probe(args.steps)))
        return 0
    columns = []
    for python in args.python or [sys.executable]:
        print(f"measuring {python} ...", file=sys.stderr, flush=True)
        columns.append(measure(python, args.runs, args.steps))
    print(table(columns))
    if args.json:
        Path(args.json).write_text(json.dumps(columns, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
