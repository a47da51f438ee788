"""Bytes per rank of parameters, summed gradients and optimizer state under ZeRO, fp32 and bf16.

    python benchmarks/zero_memory.py [--layers 4] [--hidden 256]

A stack of ``--layers`` transformer blocks (mm_parallel layers) is trained for one step with a
DistributedOptimizer on 1, 2 and 4 CPU processes (dp = world) with zero_stage 0, 1 and 2, in fp32
and in bf16 (mm_parallel.precision). Each rank reports, measured from its tensors: the parameters
it holds, the gradient sums of a step (the buffer the micro-batch gradients are added into) and
its optimizer state (fp32 master weights, exp_avg, exp_avg_sq). Printed beside the formula, with N
parameters and D = dp under ZeRO (1 without):

    parameters  4 N (fp32) / 2 N (bf16)      gradient sums  4 N (fp32 main_grad in both)
    optimizer   12 N / D (+ the padding to a multiple of D, < D values per buffer)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

PRECISIONS = ("fp32", "bf16")


def measure(layers, hidden, stages):
    """Runs on every rank: {precision: {"numel", "params", "grads", "optimizer": {stage: bytes}}}."""
    import mindspore as ms
    import numpy as np
    from recompute_memory import build

    import mm_parallel
    from mm_parallel import ParallelConfig, precision
    from mm_parallel.ops.device import as_type
    from mm_parallel.optimizer import DistributedOptimizer

    topo = mm_parallel.initialize(ParallelConfig())
    out = {}
    for name in PRECISIONS:
        policy = precision.Precision(name)
        model = build(layers, hidden, heads=8)
        precision.apply(model, policy)
        params = model.trainable_params()
        x = ms.Tensor(np.random.default_rng(0).standard_normal((1, 16, hidden)).astype(np.float32))

        def loss_fn(t):
            for block in model:
                t = block(t)
            return (t * t).mean()

        _, grads = ms.value_and_grad(loss_fn, None, params)(x)
        sums = [as_type(g, policy.accumulate_dtype) for g in grads]  # what mm_train.loop accumulates into
        optimizer = {}
        for stage in stages:
            opt = DistributedOptimizer(model, topology=topo, zero_stage=stage)
            opt.step(sums)
            optimizer[str(stage)] = opt.state_bytes()
        out[name] = {"numel": sum(int(p.size) for p in params), "params": precision.parameter_bytes(params),
                     "grads": sum(int(g.nbytes) for g in sums), "optimizer": optimizer}
    precision.activate(precision.Precision())
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    from mm_parallel.launch import run_distributed

    stages = [0, 1, 2]
    solo = measure(args.layers, args.hidden, [0])
    numel = solo["fp32"]["numel"]
    print(f"{args.layers} layers, hidden {args.hidden}: N = {numel} parameters; bytes per rank, measured (formula)")
    print(f"{'precision':>9} {'dp':>3} {'zero':>5} {'parameters':>22} {'gradient sums':>22} {'optimizer':>22} "
          f"{'optimizer / dp=1':>17}")
    runs = {1: [solo]}
    for dp in (2, 4):
        runs[dp] = run_distributed(measure, nproc=dp, timeout=600, layers=args.layers, hidden=args.hidden,
                                   stages=stages)
    for name in PRECISIONS:
        param_bytes = 2 if name == "bf16" else 4
        for dp, results in runs.items():
            for stage in ([0] if dp == 1 else stages):
                worst = max(results, key=lambda r: r[name]["optimizer"][str(stage)])[name]
                shards = dp if stage else 1
                optimizer = worst["optimizer"][str(stage)]
                cells = [(worst["params"], param_bytes * numel), (worst["grads"], 4 * numel),
                         (optimizer, 12 * numel / shards)]
                text = " ".join(f"{got:>11,} ({int(want):>9,})" for got, want in cells)
                ratio = optimizer / solo[name]["optimizer"]["0"]
                print(f"{name:>9} {dp:>3} {stage:>5} {text} {ratio:>10.4f} (1/{shards})")


if __name__ == "__main__":
    main()
