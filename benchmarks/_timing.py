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


def gemm_rate(shape, runs: int = 5) -> float:
    """MindSpore's fp32 matmul rate now, in FLOP/s: the best of ``runs`` rounds of a linear layer's
    three products at ``shape`` = (m, k, n) — y = x W^T, dx = dy W, dW = dy^T x, 6 m k n FLOPs —
    on this machine under its current load. The step's own dominant shape, not a square 1024^2:
    MindSpore's rate depends on it (here ~185 GFLOP/s at 1024^2, ~215 at 2048 x 512 x 2048)."""
    import mindspore as ms
    import numpy as np
    from mindspore import Tensor, ops

    m, k, n = shape
    rng = np.random.default_rng(0)
    x, w, dy = (Tensor(rng.standard_normal(s).astype(np.float32)) for s in ((m, k), (n, k), (m, n)))
    products = (ops.MatMul(transpose_b=True), ops.MatMul(), ops.MatMul(transpose_a=True))

    def three():
        for product, a, b in zip(products, (x, dy, dy), (w, w, x)):
            product(a, b)
        ms.runtime.synchronize()

    three()
    return best_rate(three, 6 * m * k * n, runs)


def our_train_step(model, precision: str = "fp32"):
    """(step, parts): one train step of ``model`` (forward, backward, DistributedOptimizer) in
    ``precision`` (mm_parallel.precision: bf16 is emulated on CPU), batch -> (seconds, loss), and
    its breakdown {forward, backward, optimizer: [seconds per step]}."""
    import mindspore as ms

    import mm_parallel
    from mm_parallel import precision as mixed

    policy = mixed.Precision(precision)
    mixed.apply(model, policy)
    opt = mm_parallel.DistributedOptimizer(model, mm_parallel.OptimizerConfig(lr=1e-5))
    grad_fn = ms.value_and_grad(lambda batch: model(**batch).loss, None, model.trainable_params())
    parts = {"forward": [], "backward": [], "optimizer": []}

    def step(batch):
        mixed.activate(policy)  # sides alternate in one process: each runs under its own policy
        t0 = time.perf_counter()
        model(**batch).loss.asnumpy()  # forward alone, for the breakdown only
        t1 = time.perf_counter()
        loss, grads = grad_fn(batch)
        loss.asnumpy()
        t2 = time.perf_counter()
        opt.step(grads)
        t3 = time.perf_counter()
        parts["forward"].append(t1 - t0)
        parts["backward"].append(t2 - t1 - (t1 - t0))  # value_and_grad = forward + backward
        parts["optimizer"].append(t3 - t2)
        return t3 - t1, float(loss.asnumpy())

    return step, parts


def compare_steps(ours, theirs, batch, runs: int, parts, title: str, rtol: float = 1e-5, emulated_bf16=None,
                  floor=None, goals=None) -> None:
    """Alternate ``runs`` timed train steps of ``ours`` and ``theirs`` (each a function batch ->
    (seconds, loss)) after one warm-up step each, and print the table: medians, the ratio ours /
    torch, and ours' ``parts`` ({name: [seconds per step]}, warm-up dropped).
    ``floor`` = (forward FLOPs of the step, (m, k, n) its dominant matmul shape): the floor printed
    beside is 3 x the forward FLOPs (forward + backward) over `gemm_rate` at that shape, measured
    in this run before and after the steps (the better of the two: load only slows it); ours is
    shown against it too. ``goals``: {"floor": x, "torch": y}, the ratios' goals, printed beside. The warm-up losses
    (same weights, same inputs) must agree to ``rtol``, else SystemExit: a timing of two
    different computations means nothing. ``emulated_bf16``: ours in bf16 (a step function), timed
    in the same alternation and shown beside fp32 — the cost of the CPU emulation, not a speed
    claim; its loss must be within 1e-2 of fp32's."""
    first = {"ours": ours(batch)[1], "torch": theirs(batch)[1]}
    if abs(first["ours"] - first["torch"]) > rtol * abs(first["torch"]):
        raise SystemExit(f"first-step losses differ: ours {first['ours']!r}, torch {first['torch']!r}")
    sides = {"ours": ours, "torch": theirs}
    if emulated_bf16 is not None:
        sides["ours bf16"] = emulated_bf16
        first["ours bf16"] = emulated_bf16(batch)[1]
        if abs(first["ours bf16"] - first["ours"]) > 1e-2 * abs(first["ours"]):
            raise SystemExit(f"bf16 first-step loss {first['ours bf16']!r} is off fp32's {first['ours']!r}")
    rates = [] if floor is None else [gemm_rate(floor[1])]
    times = {side: [] for side in sides}
    for _ in range(runs):
        for side in ("torch",) + tuple(s for s in sides if s != "torch"):
            times[side].append(sides[side](batch)[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    goals = goals or {}
    print(f"{title}, median of {runs}")
    print("first-step loss: " + "  ".join(f"{side} {loss:.6f}" for side, loss in first.items()))
    print(f"{'':10}{'median s':>10}{'min s':>10}")
    for side in sides:
        print(f"{side:10}{med[side]:10.3f}{min(times[side]):10.3f}")
    if floor is not None:
        rates.append(gemm_rate(floor[1]))
        flops, (m, k, n) = floor
        seconds = 3 * flops / max(rates)
        print(f"{'floor':10}{seconds:10.3f}{'':10}  = 3 x {flops / 1e9:.1f} GFLOP forward / MindSpore's matmul "
              f"{max(rates) / 1e9:.0f} GFLOP/s at {m} x {k} x {n}, measured in this run")
        print(f"ratio ours/floor: {med['ours'] / seconds:.2f}" + _goal(goals.get("floor")))
    print(f"ratio ours/torch: {med['ours'] / med['torch']:.2f}" + _goal(goals.get("torch")))
    if emulated_bf16 is not None:
        print(f"ratio ours bf16 (emulated on CPU) / ours fp32: {med['ours bf16'] / med['ours']:.2f}  "
              "(the emulation's cost, not a speed claim)")
    print("ours, where the time goes (median s): " +
          ", ".join(f"{k} {statistics.median(v[1:]):.3f}" for k, v in parts.items()))


def _goal(value) -> str:
    return "" if value is None else f"  (goal <= {value})"


def torch_video_step(build, path, threads: int, to_kwargs):
    """The torch side of a video DiT benchmark: ``build()`` (after seeding) makes the diffusers
    model, saved to ``path`` for ours to load; a step is mean((sample - target)^2), backward,
    clipping at 1.0 (as ours by default), AdamW. ``to_kwargs(batch)``: its forward keywords."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build().float().train()
    model.save_pretrained(path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step(batch):
        t0 = time.perf_counter()
        loss = ((model(**to_kwargs(batch)).sample - torch.from_numpy(batch["target"])) ** 2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0, float(loss.detach())

    return step


def video_benchmark_main(doc: str, inputs, torch_side, our_side, title, floor, goals) -> int:
    """The video DiT benchmarks' command line (--runs, --threads, --no-bf16, --frames) and run:
    ``inputs(frames)`` the batch, ``torch_side(path, threads)`` / ``our_side(path, precision)``
    the two steps (ours loads what torch saved in ``path``), ``title(args)`` the table's title,
    ``floor(config, batch)`` -> (forward FLOPs, dominant matmul shape) from the diffusers config
    saved in ``path``, ``goals`` the ratios' goals (see `compare_steps`)."""
    import argparse
    import json
    import tempfile

    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-bf16", action="store_true", help="skip the emulated bf16 step")
    parser.add_argument("--frames", type=int, default=8, help="latent frames (256 video tokens each)")
    args = parser.parse_args()
    import mm_parallel  # noqa: F401  (before any MindSpore op: blocking launch on CPU)

    batch = inputs(args.frames)
    with tempfile.TemporaryDirectory() as path:
        theirs = torch_side(path, args.threads)
        ours, parts = our_side(path)
        bf16 = None if args.no_bf16 else our_side(path, precision="bf16")[0]
        with open(f"{path}/config.json") as f:
            config = json.load(f)
        compare_steps(ours, theirs, batch, args.runs, parts, title(args), emulated_bf16=bf16,
                      floor=floor(config, batch), goals=goals)
    return 0
