"""Timing rules the benchmarks share.

Data benchmarks: the best of several runs, as items per second (the best run, not the mean: on
this shared machine other load only ever slows a run down). Train-step benchmarks: ours and
torch's steps alternate, so both see the same load, and the ratio of their medians is reported.
"""

from __future__ import annotations

import statistics
import time


def best_rate(fn, items: int, runs: int) -> float:
    """items / the fastest of ``runs`` calls of ``fn``."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return items / min(times)


def compare_steps(ours, theirs, batch, runs: int, parts, title: str, rtol: float = 1e-5) -> None:
    """Alternate ``runs`` timed train steps of ``ours`` and ``theirs`` (each a function batch ->
    (seconds, loss)) after one warm-up step each, and print the table: medians, the ratio ours /
    torch, and ours' ``parts`` ({name: [seconds per step]}, warm-up dropped). The warm-up losses
    (same weights, same inputs) must agree to ``rtol``, else SystemExit: a timing of two
    different computations means nothing."""
    first = {"ours": ours(batch)[1], "torch": theirs(batch)[1]}
    if abs(first["ours"] - first["torch"]) > rtol * abs(first["torch"]):
        raise SystemExit(f"first-step losses differ: ours {first['ours']!r}, torch {first['torch']!r}")
    times = {"ours": [], "torch": []}
    for _ in range(runs):
        times["torch"].append(theirs(batch)[0])
        times["ours"].append(ours(batch)[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{title}, median of {runs}")
    print(f"first-step loss: ours {first['ours']:.6f}  torch {first['torch']:.6f}")
    print(f"{'':10}{'median s':>10}{'min s':>10}")
    for side in ("ours", "torch"):
        print(f"{side:10}{med[side]:10.3f}{min(times[side]):10.3f}")
    print(f"ratio ours/torch: {med['ours'] / med['torch']:.2f}  (goal <= 0.8)")
    print("ours, where the time goes (median s): " +
          ", ".join(f"{k} {statistics.median(v[1:]):.3f}" for k, v in parts.items()))
