"""Memory one DistributedOptimizer step holds above its start: one bucket per group against
bounded buckets (mm_parallel.grad_buckets), alone and under dp 2 with ZeRO 0, 1 and 2.

    python benchmarks/optimizer_step_memory.py [--millions 48] [--bucket-millions 4]

Each rank holds N fp32 parameters (a few large matrices, one larger than a bucket so that it is cut)
and their fp32 gradients, as mm_train.loop hands them to the step. In a fresh process per case
(MindSpore's CPU memory pool keeps what a step freed), the peak RSS of the first step (VmHWM, reset
just before it) above the RSS before it is printed in units of 4 N bytes, for the worst rank, with
the planner's figure beside each (mm_parallel.grad_buckets.step_buffer_values, which
mm_train.plan counts).
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def measure(millions: float, zero_stage: int, bucket_numel: int) -> dict:
    """Runs on every rank: {"numel", "step_bytes", "buckets"} of one step."""
    import numpy as np
    from mindspore import Parameter, Tensor, nn

    import mm_parallel
    from mm_parallel import ParallelConfig
    from mm_parallel.grad_buckets import step_buffer_values
    from mm_parallel.optimizer import DistributedOptimizer, OptimizerConfig

    topo = mm_parallel.initialize(ParallelConfig(zero_stage=zero_stage))
    total = int(millions * 1e6)
    # a quarter in one matrix (larger than a 4M bucket: cut through), the rest in 6 equal ones
    shapes = [(total // 4 // 1000, 1000)] + [(total * 3 // 4 // 6 // 1000, 1000)] * 6
    rng = np.random.default_rng(topo.rank)

    class Model(nn.Cell):
        def __init__(self):
            super().__init__()
            for i, shape in enumerate(shapes):
                setattr(self, f"w{i}", Parameter(Tensor(rng.standard_normal(shape).astype(np.float32)), name=f"w{i}"))

    model = Model()
    grads = [Tensor(rng.standard_normal(shape).astype(np.float32)) for shape in shapes]
    opt = DistributedOptimizer(model, OptimizerConfig(lr=1e-4, bucket_numel=bucket_numel), topo)
    (grads[0] * 1.0).asnumpy()  # every kernel used once before the measurement
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux >= 4.0: VmHWM starts again from the current RSS
    start = _status_kib("VmRSS")
    opt.step(grads)
    peak = _status_kib("VmHWM")
    planned = 4 * step_buffer_values(opt.params, topo, zero_stage, bucket_numel)
    return {"numel": int(sum(a * b for a, b in shapes)), "step_bytes": (peak - start) * 1024,
            "planned_bytes": planned, "buckets": len(opt.buckets)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--millions", type=float, default=48.0, help="parameters per rank, in millions")
    parser.add_argument("--bucket-millions", type=float, default=4.0)
    args = parser.parse_args()
    from mm_parallel.launch import run_distributed

    bounded = int(args.bucket_millions * 1e6)
    print(f"one step above its start, worst rank, in units of 4 N bytes (N = {args.millions:g}M fp32 parameters "
          f"per rank); bounded buckets of {args.bucket_millions:g}M values")
    print(f"{'dp':>3} {'zero':>5} {'one bucket':>11} {'planned':>8} {'bounded':>9} {'planned':>8} {'buckets':>8} "
          f"{'one / bounded':>14}")
    for dp, stages in ((1, (0,)), (2, (0, 1, 2))):
        for stage in stages:
            row = {}
            for bucket in (0, bounded):
                results = run_distributed(measure, nproc=dp, timeout=900, millions=args.millions, zero_stage=stage,
                                          bucket_numel=bucket)
                worst = max(results, key=lambda r: r["step_bytes"])
                row[bucket] = worst
            unit = 4 * row[0]["numel"]
            one, cut = (row[b]["step_bytes"] / unit for b in (0, bounded))
            plan_one, plan_cut = (row[b]["planned_bytes"] / unit for b in (0, bounded))
            print(f"{dp:>3} {stage:>5} {one:>11.3f} {plan_one:>8.3f} {cut:>9.3f} {plan_cut:>8.3f} "
                  f"{row[bounded]['buckets']:>8} {one / max(cut, 1e-9):>13.1f}x")


if __name__ == "__main__":
    main()
