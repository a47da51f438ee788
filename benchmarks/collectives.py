"""Latency and bandwidth of every mm_parallel.comm collective, side by side with all_reduce.

    python benchmarks/collectives.py [--nproc 2 4] [--sizes 4K 64K 1M 16M] [--rounds 7]

Each size is the bytes of the tensor every rank passes in. In one msrun launch per world size,
the ops are timed in interleaved rounds (so drift on this shared machine hits them alike); a
timing is a burst of back-to-back calls after a barrier, ended by a device sync, divided by the
number of calls (as nccl-tests do: one call alone mostly measures how late the slowest rank
arrives). The table shows the median over rounds (slowest rank),
the bus bandwidth (input bytes / time) and the ratio to all_reduce of the same bytes in the same
run. Emulated ops on CPU (reduce_scatter, all_to_all, p2p) aim for <= 1.5x that all_reduce.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

OPS = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "ring_shift", "exchange", "send_recv"]
EMULATED_ON_CPU = {"reduce_scatter", "all_to_all", "ring_shift", "exchange", "send_recv"}


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def measure(sizes, rounds):
    """Runs on every rank: {size: {op: [ms per round]}} for this rank."""
    import mindspore as ms
    from mindspore import Tensor

    import mm_parallel
    from mm_parallel import comm

    topo = mm_parallel.initialize(mm_parallel.ParallelConfig())
    world, me = topo.world, topo.rank
    n = world.size
    peer = me ^ 1 if (me ^ 1) < n else me

    def send_recv(x):
        # rank 0 -> last rank: the pipeline's one-way transfer; the others idle
        if me == 0:
            comm.send(x, n - 1)
            return x
        if me == n - 1:
            return comm.recv(x.shape, x.dtype, 0)
        return x

    calls = {
        "all_reduce": lambda x: comm.all_reduce(x, world),
        "all_gather": lambda x: comm.all_gather(x, world),
        "reduce_scatter": lambda x: comm.reduce_scatter(x, world),
        "all_to_all": lambda x: comm.all_to_all(x, world, 0, 0),
        "broadcast": lambda x: comm.broadcast(x, 0, world),
        "ring_shift": lambda x: comm.ring_shift(x, world),
        "exchange": lambda x: comm.exchange(x, peer),
        "send_recv": send_recv,
    }
    results = {}
    for size in sizes:
        x = Tensor(np.random.default_rng(me).standard_normal(size // 4).astype(np.float32))
        times = {op: [] for op in OPS}
        for op in OPS:  # warm-up: creates the groups and the kernels
            calls[op](x).asnumpy()
        calls_per_timing = max(2, min(20, (8 << 20) // size))  # amortise launch skew at small sizes
        for _ in range(rounds):
            for op in OPS:
                comm.barrier(world)
                start = time.perf_counter()
                for _ in range(calls_per_timing):
                    out = calls[op](x)
                ms.runtime.synchronize()
                out.asnumpy()
                times[op].append((time.perf_counter() - start) * 1e3 / calls_per_timing)
        results[str(size)] = times
    return results


def _label(size: int) -> str:
    return f"{size >> 20} MB" if size >= 1 << 20 else f"{size >> 10} KB"


def table(nproc, per_rank, sizes) -> str:
    lines = [
        f"\n{nproc} processes (median ms over rounds, slowest rank; ratio = op / all_reduce of the same bytes)\n",
        "| bytes/rank | " + " | ".join(OPS) + " |",
        "|---|" + "---|" * len(OPS),
    ]
    worst = 0.0
    for size in sizes:
        med = {op: max(statistics.median(r[str(size)][op]) for r in per_rank) for op in OPS}
        base = med["all_reduce"]
        cells = []
        for op in OPS:
            ratio = med[op] / base
            if op in EMULATED_ON_CPU:
                worst = max(worst, ratio)
            cells.append(f"{med[op]:.2f} ({ratio:.2f}x)")
        bandwidth = size / (base / 1e3) / 1e6
        lines.append(f"| {_label(size)} (all_reduce {bandwidth:.1f} MB/s) | " + " | ".join(cells) + " |")
    lines.append(f"\nworst emulated op / all_reduce: {worst:.2f}x (goal <= 1.5x)")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", nargs="+", default=["4K", "64K", "1M", "16M"])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    sizes = [_parse_size(s) for s in args.sizes]

    from mm_parallel.launch import run_distributed

    for nproc in args.nproc:
        per_rank = run_distributed(measure, nproc=nproc, timeout=1800, sizes=sizes, rounds=args.rounds)
        print(table(nproc, per_rank, sizes), flush=True)


if __name__ == "__main__":
    main()
