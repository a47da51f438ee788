"""Bytes per rank of parameters, summed gradients and optimizer state under ZeRO, fp32 and bf16;
a whole step under ZeRO-3 against ZeRO-1 on 2 processes.

    python benchmarks/zero_memory.py [--layers 4] [--hidden 256] [--step-hidden 1024]

A stack of ``--layers`` transformer blocks (mm_parallel layers) is trained for one step with a
DistributedOptimizer on 1, 2 and 4 CPU processes (dp = world) with zero_stage 0, 1 and 2, in fp32
and in bf16 (mm_parallel.precision), and zero_stage 3 (mm_parallel.zero3: the linear weights
cut into flat slices). Each rank reports, measured from its tensors: the parameters it
holds, the gradient sums of a step (the buffer the micro-batch gradients are added into) and its
optimizer state (fp32 master weights, exp_avg, exp_avg_sq). Printed beside the formula, with N
parameters, D = dp under ZeRO (1 without) and, under ZeRO-3, N_w the values left whole (norms,
biases):

    parameters  4 N (fp32) / 2 N (bf16)      gradient sums  4 N (fp32 main_grad in both)
    optimizer   12 N / D (+ the padding to a multiple of D, < D values per buffer)
    ZeRO-3      N_s = N - N_w in float32 slices, each its own master weight: parameters
                4 N_s / D + b N_w (b = 2 in bf16), gradient sums 4 (N_s / D + N_w), optimizer
                8 N_s / D + 12 N_w / D; with optim.offload the optimizer's bytes in host memory

Then a whole step (forward, backward, optimizer) of ``--layers`` blocks of ``--step-hidden`` on 16
tokens (the weights dominate) on 2 processes, ZeRO-1 against ZeRO-3: the peak RSS of the step
above the RSS before the model was built (VmHWM, reset at the start) on the worst rank, and the
median step time of 3 steps after one warm-up, side by side with the ratios (goals: peak <= 0.6 x,
time <= 1.3 x ZeRO-1's); and ZeRO-3 with the optimizer state offloaded (optim.offload) against
ZeRO-3 resident.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

PRECISIONS = ("fp32", "bf16")
GOALS = {"peak": 0.6, "time": 1.3}


def loss_fn(t, model):
    for block in model:
        t = block(t)
    return (t * t).mean()


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def step(layers, hidden, stage, offload=False) -> dict:
    """Runs on every rank: {"peak_bytes", "step_s"} of whole steps under ``stage`` (module docstring)."""
    import gc
    import statistics
    import time

    import mindspore as ms
    import numpy as np
    from recompute_memory import build

    import mm_parallel
    from mm_parallel import ParallelConfig, zero3
    from mm_parallel.optimizer import DistributedOptimizer, OptimizerConfig

    topo = mm_parallel.initialize(ParallelConfig(zero_stage=stage))
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux >= 4.0: VmHWM starts again from the current RSS
    start = _status_kib("VmRSS")
    model = build(layers, hidden, heads=8)
    if stage == 3:
        zero3.shard_parameters(model, topo, min_numel=1)
    params = model.trainable_params()
    opt = DistributedOptimizer(model, OptimizerConfig(offload="optimizer" if offload else None), topology=topo,
                               zero_stage=stage)
    x = ms.Tensor(np.random.default_rng(topo.rank).standard_normal((1, 16, hidden)).astype(np.float32))
    grad = ms.value_and_grad(lambda t: loss_fn(t, model), None, params)
    seconds = []
    for _ in range(4):
        begin = time.perf_counter()
        _, grads = grad(x)
        opt.step(grads)
        seconds.append(time.perf_counter() - begin)
        del grads
    return {"peak_bytes": (_status_kib("VmHWM") - start) * 1024, "step_s": statistics.median(seconds[1:])}


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

        _, grads = ms.value_and_grad(lambda t: loss_fn(t, model), None, params)(x)
        sums = [as_type(g, policy.accumulate_dtype) for g in grads]  # what mm_train.loop accumulates into
        optimizer = {}
        for stage in [s for s in stages if s < 3]:
            opt = DistributedOptimizer(model, topology=topo, zero_stage=stage)
            opt.step(sums)
            optimizer[str(stage)] = opt.state_bytes()
        out[name] = {"numel": sum(int(p.size) for p in params), "params": precision.parameter_bytes(params),
                     "grads": sum(int(g.nbytes) for g in sums), "optimizer": optimizer}
        if 3 in stages:  # a model of its own: ZeRO-3 cuts its weights in place
            model = build(layers, hidden, heads=8)
            precision.apply(model, policy)
            out[name]["zero3"] = _zero3_bytes(model, x, topo, policy)
    precision.activate(precision.Precision())
    return out


def _zero3_bytes(model, x, topo, policy) -> dict:
    """A rank's bytes under ZeRO-3: its weight slices and whole small parameters, their gradient
    sums and the optimizer state (in device memory; in host memory with optim.offload); the
    values left whole."""
    import mindspore as ms

    from mm_parallel import zero3
    from mm_parallel.ops.device import as_type
    from mm_parallel.optimizer import DistributedOptimizer, OptimizerConfig

    done = zero3.shard_parameters(model, topo, min_numel=1)
    params = model.trainable_params()
    _, grads = ms.value_and_grad(lambda t: loss_fn(t, model), None, params)(x)
    sums = [as_type(g, policy.accumulate_dtype) if zero3.value_dtype(p) == p.dtype else g  # a slice's: fp32
            for p, g in zip(params, grads)]
    opt = DistributedOptimizer(model, topology=topo, zero_stage=3)
    opt.step(sums)
    offloaded = DistributedOptimizer(model, OptimizerConfig(offload="optimizer"), topology=topo, zero_stage=3)
    return {"params": sum(int(p.nbytes) for p in params), "grads": sum(int(g.nbytes) for g in sums),
            "optimizer": opt.state_bytes(), "offloaded_device": offloaded.state_bytes(),
            "offloaded_host": offloaded.host_state_bytes(), "whole_numel": done.whole_numel}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--step-hidden", type=int, default=1024)
    args = parser.parse_args()
    from mm_parallel.launch import run_distributed

    stages = [0, 1, 2, 3]
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
            for stage in ([0] if dp == 1 else stages[:3]):
                worst = max(results, key=lambda r: r[name]["optimizer"][str(stage)])[name]
                shards = dp if stage else 1
                optimizer = worst["optimizer"][str(stage)]
                cells = [(worst["params"], param_bytes * numel), (worst["grads"], 4 * numel),
                         (optimizer, 12 * numel / shards)]
                text = " ".join(f"{got:>11,} ({int(want):>9,})" for got, want in cells)
                ratio = optimizer / solo[name]["optimizer"]["0"]
                print(f"{name:>9} {dp:>3} {stage:>5} {text} {ratio:>10.4f} (1/{shards})")
    print("ZeRO-3: N_s values in slices (float32, each its own master weight), N_w whole (norms, biases): "
          "parameters 4 N_s / D + b N_w, gradient sums 4 (N_s / D + N_w), optimizer 8 N_s / D + 12 N_w / D")
    for name in PRECISIONS:
        for dp in (2, 4):
            worst = max((r[name]["zero3"] for r in runs[dp]), key=lambda r: r["params"])
            whole = worst["whole_numel"]
            cells = [(worst["params"], 4 * (numel - whole) / dp + (2 if name == "bf16" else 4) * whole),
                     (worst["grads"], 4 * ((numel - whole) / dp + whole)),
                     (worst["optimizer"], 8 * (numel - whole) / dp + 12 * whole / dp)]
            text = " ".join(f"{got:>11,} ({int(want):>9,})" for got, want in cells)
            total = sum(got for got, _ in cells)
            print(f"{name:>9} {dp:>3} {3:>5} {text} {worst['optimizer'] / solo[name]['optimizer']['0']:>10.4f} "
                  f"(1/{dp}; {whole:,} whole) total {total:,} = {total * dp / numel:.2f} N / dp (issue's "
                  f"(2 + 4 + 12) N / dp = {18 * numel // dp:,}); offloaded: device {worst['offloaded_device']:,}, "
                  f"host {worst['offloaded_host']:,} (12 N / dp = {12 * numel // dp:,} + padding)")
    steps = {(stage, offload): run_distributed(step, nproc=2, timeout=900, layers=args.layers,
                                               hidden=args.step_hidden, stage=stage, offload=offload)
             for stage, offload in ((1, False), (3, False), (3, True))}
    peak = {key: max(r["peak_bytes"] for r in results) for key, results in steps.items()}
    time_s = {key: max(r["step_s"] for r in results) for key, results in steps.items()}
    one, three, off = (1, False), (3, False), (3, True)
    print(f"a step of {args.layers} layers of hidden {args.step_hidden} on 2 processes: ZeRO-1 peak "
          f"{peak[one] / 2 ** 20:,.0f} MiB, {time_s[one] * 1e3:.0f} ms; ZeRO-3 peak {peak[three] / 2 ** 20:,.0f} MiB, "
          f"{time_s[three] * 1e3:.0f} ms: peak {peak[three] / peak[one]:.2f}x (goal <= {GOALS['peak']}x), time "
          f"{time_s[three] / time_s[one]:.2f}x (goal <= {GOALS['time']}x)")
    print(f"ZeRO-3 with optim.offload optimizer: {time_s[off] * 1e3:.0f} ms, {time_s[off] / time_s[three]:.2f}x "
          f"ZeRO-3's step (the state streamed through host copies; on CPU host and device memory are one, so "
          f"the peak RSS, {peak[off] / 2 ** 20:,.0f} MiB, shows no saving: the device bytes above do)")


if __name__ == "__main__":
    main()
