"""Pipeline bubble of the 1F1B schedule, measured against theory (p - 1) / (m + p - 1).

    python benchmarks/pipeline_bubble.py [--pp 2 4] [--micro 1 2 4 8] [--work 0.15]

Each stage is one layer whose forward sleeps ``--work`` seconds (synthetic compute: it holds no
core, so the 2-core machine does not serialise the stages and the figure is the schedule's own).
A stage's backward recomputes its forward (mm_parallel.pipeline), so a micro-batch keeps a stage
busy 2 x work, except on the last stage where forward and backward are one call (1 x work): the
ideal step is m x 2 x work on rank 0. Measured bubble = 1 - ideal / step time on rank 0, median
of ``--rounds`` steps. Printed beside it: the textbook (p - 1) / (m + p - 1), which assumes every
stage costs the same, and the bubble of the same 1F1B order simulated with these stage costs
and free transfers (the last stage is cheaper, so the bubble is smaller). What remains between
simulation and measurement is the transfers (two collectives each, 15-35 ms on CPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def measure(pp, vpp, micro, work, rounds):
    """Runs on every rank: {m: median step seconds} for this rank (vpp chunks of work / vpp each)."""
    from mindspore import Parameter, Tensor, nn

    import mm_parallel
    from mm_parallel import ParallelConfig
    from mm_parallel.pipeline import train_step_1f1b, train_step_interleaved

    topo = mm_parallel.initialize(ParallelConfig(pp=pp, vpp=vpp))

    class Layer(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = Parameter(Tensor(np.ones((1, 8), np.float32)), name="w")

        def construct(self, x):
            time.sleep(work / vpp)
            return x * self.w

    layers = [Layer() for _ in range(vpp)]
    x = Tensor(np.ones((1, 8), np.float32))
    out = {}
    for m in micro:
        batches = [(x, x)] * m
        times = []
        for _ in range(rounds):
            mm_parallel.comm.barrier(topo.world)
            start = time.perf_counter()
            loss = lambda y, t: (y * t).sum()
            if vpp == 1:
                train_step_1f1b(layers[0], layers[0].trainable_params(), batches, loss, topo)
            else:
                train_step_interleaved(layers, [c.trainable_params() for c in layers], batches, loss, topo)
            times.append(time.perf_counter() - start)
        out[str(m)] = statistics.median(times)
    return out


def simulate_1f1b(p, m, forward, backward):
    """Step time of 1F1B with per-stage costs forward[s], backward[s] and instant transfers."""
    order = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        ops = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            ops += [("F", warmup + i), ("B", i)]
        order.append(ops + [("B", i) for i in range(m - warmup, m)])
    done, free, cursor = {}, [0.0] * p, [0] * p
    while any(cursor[s] < len(order[s]) for s in range(p)):
        for s in range(p):
            while cursor[s] < len(order[s]):
                kind, i = order[s][cursor[s]]
                need = [("F", s - 1, i)] if kind == "F" and s > 0 else []
                need += [("B", s + 1, i)] if kind == "B" and s < p - 1 else []
                need += [("F", s, i)] if kind == "B" else []
                if any(n not in done for n in need):
                    break
                start = max([free[s]] + [done[n] for n in need])
                free[s] = done[(kind, s, i)] = start + (forward[s] if kind == "F" else backward[s])
                cursor[s] += 1
    return max(free)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--vpp", type=int, default=2, help="also run the interleaved schedule with this many chunks")
    parser.add_argument("--work", type=float, default=0.15)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from mm_parallel.launch import run_distributed

    print(f"synthetic stage forward {args.work * 1000:.0f} ms; bubble = 1 - m * 2 * work / step time (rank 0)")
    print(f"{'pp':>3} {'m':>3} {'step s':>8} {'measured':>9} {'simulated':>10} {'textbook':>9}")
    for pp in args.pp:
        per_rank = run_distributed(measure, nproc=pp, timeout=900, pp=pp, vpp=1, micro=args.micro, work=args.work,
                                   rounds=args.rounds)
        for m in args.micro:
            step = per_rank[0][str(m)]
            ideal = m * 2 * args.work
            forward = [args.work] * (pp - 1) + [0.0]  # the last stage's forward runs inside its backward
            backward = [args.work] * pp
            simulated = 1 - ideal / simulate_1f1b(pp, m, forward, backward)
            textbook = (pp - 1) / (m + pp - 1)
            print(f"{pp:>3} {m:>3} {step:>8.2f} {1 - ideal / step:>9.3f} {simulated:>10.3f} {textbook:>9.3f}")
    if args.vpp > 1:
        print(f"interleaved, vpp={args.vpp} chunks of {args.work / args.vpp * 1000:.0f} ms (m a multiple of pp); "
              "textbook bubble divided by vpp")
        print(f"{'pp':>3} {'m':>3} {'step s':>8} {'measured':>9} {'textbook/v':>11}")
        for pp in args.pp:
            micro = [m for m in args.micro if m % pp == 0]
            per_rank = run_distributed(measure, nproc=pp, timeout=900, pp=pp, vpp=args.vpp, micro=micro,
                                       work=args.work, rounds=args.rounds)
            for m in micro:
                step = per_rank[0][str(m)]
                textbook = (pp - 1) / (m + pp - 1) / args.vpp
                print(f"{pp:>3} {m:>3} {step:>8.2f} {1 - m * 2 * args.work / step:>9.3f} {textbook:>11.3f}")


if __name__ == "__main__":
    main()
