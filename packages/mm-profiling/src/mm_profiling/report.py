"""``mm-profile report DIR [--out OUT]``: a Markdown summary and a PNG chart of collected traces.

Reads every ``trace_view.json`` under DIR (one per profiled rank; the file chrome://tracing,
Perfetto and MindStudio Insight open) and writes, per trace, into OUT (default DIR):

  report.md          span of the capture, operator time, communication vs computation share,
                     host time between operators, top operators by total time, and a per-step
                     breakdown (wall, in operators, communication, host) when StepProfiler
                     recorded the step boundaries
  report_<n>.png     the top operators as a bar chart (communication in its own colour)

Operator events are the trace's complete ("X") events of operator processes (CPU ops on CPU,
kernels on Ascend); aggregated scope layers are skipped so no time is counted twice.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import defaultdict
from typing import Dict, List, Optional

COMMUNICATION = re.compile(r"allreduce|allgather|reducescatter|broadcast|alltoall|send|recv|receive|barrier|hcom|"
                           r"distcomm|collective", re.IGNORECASE)
_SKIPPED_PROCESSES = re.compile(r"scope|step|overlap|python|ascend hardware summary", re.IGNORECASE)


def operator_type(name: str) -> str:
    """'Default/Grad/MatMul-op12' -> 'MatMul'."""
    return re.sub(r"-op\d+$", "", name.rsplit("/", 1)[-1])


def _step_boundaries(trace_file: str) -> List[Dict]:
    """Steps recorded by StepProfiler next to the trace's capture folder (steps_<first>.json)."""
    folder = os.path.dirname(os.path.dirname(os.path.dirname(trace_file)))  # rank_<r>/<capture>/ASCEND_.../
    steps = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.startswith("steps_") and name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                steps += [s for s in json.load(f)["steps"] if "end_us" in s]
    return steps


def _per_step(ops: List[Dict], steps: List[Dict]) -> List[Dict]:
    """Per step: wall time, operator time, communication time of the operators inside it."""
    rows = []
    for s in steps:
        inside = [e for e in ops if s["start_us"] <= float(e["ts"]) < s["end_us"]]
        busy = sum(float(e["dur"]) for e in inside)
        comm = sum(float(e["dur"]) for e in inside if COMMUNICATION.search(operator_type(e["name"])))
        rows.append({"step": s["step"], "wall_us": s["end_us"] - s["start_us"], "busy_us": busy,
                     "communication_us": comm, "operators": len(inside)})
    return rows


def summarize(trace_file: str) -> Dict:
    """{span_us, busy_us, communication_us, operators: {type: {"time_us", "count"}}, steps: [...]}
    of one trace (steps: per-step rows when StepProfiler recorded the boundaries)."""
    with open(trace_file) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e["pid"]: e["args"].get("name", "")
             for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    ops = [e for e in events if e.get("ph") == "X" and not _SKIPPED_PROCESSES.search(names.get(e.get("pid"), ""))]
    if not ops:
        raise ValueError(f"{trace_file} holds no operator events")
    operators = defaultdict(lambda: {"time_us": 0.0, "count": 0})
    for e in ops:
        entry = operators[operator_type(e["name"])]
        entry["time_us"] += float(e["dur"])
        entry["count"] += 1
    start = min(float(e["ts"]) for e in ops)
    end = max(float(e["ts"]) + float(e["dur"]) for e in ops)
    busy = sum(v["time_us"] for v in operators.values())
    comm = sum(v["time_us"] for k, v in operators.items() if COMMUNICATION.search(k))
    steps = [s for s in _step_boundaries(trace_file) if s["end_us"] >= start and s["start_us"] <= end]
    return {"span_us": end - start, "busy_us": busy, "communication_us": comm, "operators": dict(operators),
            "steps": _per_step(ops, steps)}


def _markdown(label: str, s: Dict, chart: Optional[str], top: int) -> str:
    span, busy, comm = s["span_us"], s["busy_us"], s["communication_us"]
    ranked = sorted(s["operators"].items(), key=lambda kv: -kv[1]["time_us"])[:top]
    lines = [f"## {label}", "",
             f"- captured span: {span / 1e3:.1f} ms; operators busy {busy / 1e3:.1f} ms "
             f"({100 * busy / span:.0f}% of the span); host time between operators {max(span - busy, 0) / 1e3:.1f} ms",
             f"- communication {comm / 1e3:.1f} ms ({100 * comm / busy:.1f}% of operator time), "
             f"computation {(busy - comm) / 1e3:.1f} ms ({100 * (busy - comm) / busy:.1f}%)", "",
             "| operator | calls | total ms | share |", "|---|---|---|---|"]
    lines += [f"| {name} | {v['count']} | {v['time_us'] / 1e3:.2f} | {100 * v['time_us'] / busy:.1f}% |"
              for name, v in ranked]
    if s["steps"]:
        lines += ["", "| step | wall ms | in operators ms | communication ms | host / other ms | operators |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['step']} | {r['wall_us'] / 1e3:.2f} | {r['busy_us'] / 1e3:.2f} | "
                  f"{r['communication_us'] / 1e3:.2f} | {max(r['wall_us'] - r['busy_us'], 0) / 1e3:.2f} | "
                  f"{r['operators']} |" for r in s["steps"]]
    if chart:
        lines += ["", f"![top operators]({chart})"]
    return "\n".join(lines) + "\n"


def _chart(s: Dict, path: str, title: str, top: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranked = sorted(s["operators"].items(), key=lambda kv: -kv[1]["time_us"])[:top][::-1]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(ranked) + 1.2))
    colours = ["tab:red" if COMMUNICATION.search(k) else "tab:blue" for k, _ in ranked]
    ax.barh([k for k, _ in ranked], [v["time_us"] / 1e3 for _, v in ranked], color=colours)
    ax.set_xlabel("total time (ms); red: communication")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(directory: str, out: Optional[str] = None, top: int = 15) -> str:
    """Write report.md (and one chart per trace) for every trace under ``directory``; returns its path."""
    out = out or directory
    traces = sorted(os.path.join(root, f) for root, _, files in os.walk(directory) for f in files
                    if f == "trace_view.json")
    if not traces:
        raise FileNotFoundError(f"no trace_view.json under {directory}: point at a profile save_path")
    os.makedirs(out, exist_ok=True)
    parts: List[str] = [f"# Profile report: {directory}", ""]
    for n, trace in enumerate(traces):
        label = os.path.relpath(trace, directory)
        summary = summarize(trace)
        chart = f"report_{n}.png"
        _chart(summary, os.path.join(out, chart), f"top operators: {label.split(os.sep)[0]}", top)
        parts.append(_markdown(label, summary, chart, top))
    path = os.path.join(out, "report.md")
    with open(path, "w") as f:
        f.write("\n".join(parts))
    return path


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mm-profile", description="Summaries of collected profiles.")
    commands = parser.add_subparsers(dest="command", required=True)
    rep = commands.add_parser("report", help="write a Markdown summary and PNG charts of the traces under DIR")
    rep.add_argument("directory", metavar="DIR")
    rep.add_argument("--out", default=None, help="output folder (default: DIR)")
    rep.add_argument("--top", type=int, default=15, help="operators listed (default 15)")
    args = parser.parse_args(argv)
    try:
        print(report(args.directory, args.out, args.top))
    except (FileNotFoundError, ValueError) as error:
        print(f"mm-profile: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
