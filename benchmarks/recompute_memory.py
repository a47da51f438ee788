"""Activation memory and step time of recomputation, side by side with no recompute.

    python benchmarks/recompute_memory.py [--layers 12] [--seq 1024] [--hidden 256] [--steps 3]

A pre-norm transformer of ``--layers`` blocks (attention through CoreAttention, GELU MLP, built
from mm_parallel's layers in a world of one) takes train steps (forward, backward to every weight)
under each recompute mode. Each mode runs in a fresh process: the memory figure is the peak host
RSS of the first full step above the RSS before it (the model, inputs, MindSpore itself and a
warm-up step on a 16-token sequence excluded); the time is the median of the following steps.
The goal for full recompute is >= 60% less activation memory than none; the table prints each
mode's saving and step-time ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

MODES = ["none", "selective", "block", "full"]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def build(layers, hidden, heads):
    from mindspore import Parameter, Tensor, nn

    from mm_parallel import ops as K
    from mm_parallel.recompute import CoreAttention
    from mm_parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            self.qkv = ColumnParallelLinear(hidden, 3 * hidden)
            self.core = CoreAttention(causal=True)
            self.o = RowParallelLinear(hidden, hidden)
            self.up = ColumnParallelLinear(hidden, 4 * hidden)
            self.down = RowParallelLinear(4 * hidden, hidden)
            self.norm1 = Parameter(Tensor(np.ones(hidden, np.float32)), name="norm1")
            self.norm2 = Parameter(Tensor(np.ones(hidden, np.float32)), name="norm2")

        def construct(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(K.rms_norm(x, self.norm1)).reshape(b, s, 3, heads, -1).unbind(2)
            x = x + self.o(self.core(q, k, v).reshape(b, s, -1))
            return x + self.down(K.gelu(self.up(K.rms_norm(x, self.norm2))))

    return nn.CellList([Block() for _ in range(layers)])


def worker(mode, layers, seq, hidden, heads, batch, steps):
    """One mode in this process: prints {"activation_bytes", "step_s"} as JSON."""
    import mindspore as ms
    from mindspore import Tensor

    import mm_parallel  # noqa: F401  (before any op: see mm_parallel.runtime)
    from mm_parallel.recompute import apply_recompute

    stack = build(layers, hidden, heads)
    apply_recompute(stack, mode, num_layers=layers // 2 if mode == "block" else None)
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((batch, seq, hidden)).astype(np.float32))
    params = stack.trainable_params()

    def loss_fn(t):
        for block in stack:
            t = block(t)
        return (t * t).mean()

    step = ms.value_and_grad(loss_fn, None, params)
    step(x[:, :16])  # one-time costs (kernel set-up, thread pools) on a short sequence, outside the figure
    before = _rss_bytes()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss, grads = step(x)
        float(loss.asnumpy()), [g.asnumpy() for g in grads]
        times.append(time.perf_counter() - start)
        if len(times) == 1:
            activation = _peak_rss_bytes() - before
    print(json.dumps({"activation_bytes": activation, "step_s": statistics.median(times[1:] or times)}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = (args.layers, args.seq, args.hidden, args.heads, args.batch, args.steps)
    if args.worker:
        worker(args.worker, *shape)
        return
    print(f"{args.layers} layers, batch {args.batch} x seq {args.seq} x hidden {args.hidden}, {args.heads} heads; "
          f"block = first {args.layers // 2} layers")
    results = {}
    for mode in MODES:
        cmd = [sys.executable, __file__, "--worker", mode, "--layers", str(args.layers), "--seq", str(args.seq),
               "--hidden", str(args.hidden), "--heads", str(args.heads), "--batch", str(args.batch),
               "--steps", str(args.steps)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    base = results["none"]
    print(f"{'mode':<10} {'activation MB':>14} {'saved vs none':>14} {'step s':>8} {'time vs none':>13}")
    for mode, r in results.items():
        saved = 1 - r["activation_bytes"] / base["activation_bytes"]
        print(f"{mode:<10} {r['activation_bytes'] / 2**20:>14.0f} {saved:>13.0%} {r['step_s']:>8.2f} "
              f"{r['step_s'] / base['step_s']:>12.2f}x")
    full_saving = 1 - results["full"]["activation_bytes"] / base["activation_bytes"]
    print(f"full recompute saves {full_saving:.0%} of activation memory (goal >= 60%): "
          f"{'met' if full_saving >= 0.6 else 'NOT met'}")


if __name__ == "__main__":
    main()
