"""The timing rule the data benchmarks share: the best of several runs, as items per second.

(The best run, not the mean: on this shared machine other load only ever slows a run down.)
"""

from __future__ import annotations

import time


def best_rate(fn, items: int, runs: int) -> float:
    """items / the fastest of ``runs`` calls of ``fn``."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return items / min(times)
