"""Optimizer state per rank under ZeRO, side by side with one data-parallel rank.

    python benchmarks/zero_memory.py [--layers 4] [--hidden 256]

A stack of ``--layers`` transformer blocks (mm_parallel layers) gets a DistributedOptimizer on
1, 2 and 4 CPU processes (dp = world) with zero_stage 0, 1 and 2; each rank reports the bytes of
optimizer state it holds (fp32 master weights, exp_avg, exp_avg_sq). Goal: stage 1 and 2 hold
exactly 1/dp of the dp=1 state plus the padding to a multiple of dp (< dp values per buffer).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def state_bytes(layers, hidden, stages):
    """Runs on every rank: {stage: optimizer state bytes on this rank}."""
    from recompute_memory import build

    import mm_parallel
    from mm_parallel import ParallelConfig
    from mm_parallel.optimizer import DistributedOptimizer

    topo = mm_parallel.initialize(ParallelConfig())
    model = build(layers, hidden, heads=8)
    return {str(stage): DistributedOptimizer(model, topology=topo, zero_stage=stage).state_bytes() for stage in stages}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    from mm_parallel.testing import run_distributed

    stages = [0, 1, 2]
    solo = state_bytes(args.layers, args.hidden, [0])["0"]
    print(f"{args.layers} layers, hidden {args.hidden}: dp=1 optimizer state {solo / 2**20:.2f} MiB per rank")
    print(f"{'dp':>3} {'zero':>5} {'MiB per rank (max)':>19} {'ratio to dp=1':>14} {'1/dp':>7} {'excess bytes':>13}")
    for dp in (2, 4):
        per_rank = run_distributed(state_bytes, nproc=dp, timeout=600, layers=args.layers, hidden=args.hidden,
                                   stages=stages)
        for stage in stages:
            most = max(r[str(stage)] for r in per_rank)
            ideal = solo / dp if stage else solo
            print(f"{dp:>3} {stage:>5} {most / 2**20:>19.3f} {most / solo:>14.4f} {1 / dp:>7.4f} {most - ideal:>13.0f}")


if __name__ == "__main__":
    main()
