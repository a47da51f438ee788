"""What a backward costs in MindSpore PyNative, in forwards: the two facts `mm-train plan`'s passes
rest on (mm_train.plan.timing), measured side by side in one run.

    python benchmarks/backward_passes.py

1. A LoRA step: 4 linear layers (1024 wide, 2048 rows) with rank-8 adapters, a train step's time
   over a forward's with the base weights trained and with them frozen (only the adapters take
   gradients). The plan counts 3 forwards and 2: frozen weights need no weight gradient.
2. A deferred backward: `mindspore.vjp` returns the output and a function for the backward; the
   forward's Python runs again when that function is called, so a pipeline stage that sends its
   output on and backpropagates later pays its forward twice (mm_parallel.pipeline). Counted by
   the calls to the forward function.
"""

from __future__ import annotations

import time

import numpy as np


def _median_seconds(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def lora_step_in_forwards(layers: int = 4, width: int = 1024, rows: int = 2048, rank: int = 8):
    """(a full step, a step with the base weights frozen) in forwards."""
    import mindspore as ms
    from mindspore import ops

    rng = np.random.default_rng(0)

    def parameter(shape, name):
        return ms.Parameter(ms.Tensor(rng.standard_normal(shape).astype(np.float32) * 0.02), name=name)

    base = [parameter((width, width), f"w{i}") for i in range(layers)]
    down = [parameter((width, rank), f"a{i}") for i in range(layers)]
    up = [parameter((rank, width), f"b{i}") for i in range(layers)]
    x = ms.Tensor(rng.standard_normal((rows, width)).astype(np.float32))

    def forward(inputs):
        for w, a, b in zip(base, down, up):
            inputs = ops.tanh(ops.matmul(inputs, w) + ops.matmul(ops.matmul(inputs, a), b))
        return (inputs ** 2).sum()

    def step(weights):
        grad = ms.value_and_grad(forward, None, weights)
        return lambda: [g.asnumpy() for g in grad(x)[1]]

    once = _median_seconds(lambda: forward(x).asnumpy())
    full = _median_seconds(step(base + down + up))
    for w in base:
        w.requires_grad = False
    adapters = _median_seconds(step(down + up))
    return full / once, adapters / once


def vjp_forward_calls() -> int:
    """How many times the forward runs for one output and one deferred backward."""
    import mindspore as ms
    from mindspore import ops

    calls = []
    weight = ms.Parameter(ms.Tensor(np.ones((4, 4), np.float32)), name="w")

    def forward(x):
        calls.append(1)
        return ops.matmul(x, weight)

    out, backward = ms.vjp(forward, ms.Tensor(np.ones((2, 4), np.float32)), weights=[weight])
    backward(ops.ones_like(out))
    return len(calls)


def main():
    import mindspore as ms

    full, adapters = lora_step_in_forwards()
    print(f"MindSpore {ms.__version__}, PyNative, CPU")
    print(f"train step of 4 linear layers with adapters: {full:.2f} forwards with the base weights trained, "
          f"{adapters:.2f} with them frozen (the plan: 3 and 2)")
    print(f"forward runs for one vjp output and its deferred backward: {vjp_forward_calls()} (1 would mean the "
          "forward's graph was kept)")


if __name__ == "__main__":
    main()
