"""Graph mode (ms.jit) against PyNative on this CPU: what it would buy a DiT block, and whether the
written-out backwards of mm_parallel.ops survive it.

    python benchmarks/graph_mode.py [--tokens 2048] [--runs 3]

1. Speed, forward + backward of one Wan-sized DiT block (dim 512 = 4 heads x 128, FFN 2048, 64
   text tokens): the block written plainly in MindSpore ops (what ms.jit compiles as it is), run
   eagerly and under ms.jit, next to mm's own Wan block in PyNative (tiled operands, row sums as
   matmuls, written-out backwards). Steps alternate between the three; medians are printed.
2. Correctness: a Cell with a written backward (``bprop``), as mm_parallel.ops uses for tile,
   gelu, softmax, layer norm and the attention core, called twice in one function: the gradient
   under ms.jit against PyNative's and the exact one.

Issue 27 asked for a graph-mode option (``model.compile: blocks``). This script is the measured
reason it is not offered on MindSpore 2.7.2: compiled, the plain block stays slower than the
eager mm block (1.03 against 0.68 s here), and the written-out backwards that make the eager block fast give wrong
gradients under ms.jit as soon as one Cell serves two call sites (part 2).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

DIM, HEADS, FFN, TEXT = 512, 4, 2048, 64


def plain_block():
    """A Wan-style block (modulated self-attention with q/k RMSNorm, cross-attention, gelu-tanh
    FFN) in plain MindSpore ops: broadcasting, mean reductions, autodiff backwards."""
    from mindspore import Parameter, Tensor, nn, ops

    rng = np.random.default_rng(0)
    matmul_nt = ops.MatMul(transpose_b=True)

    class Linear(nn.Cell):
        def __init__(self, fan_in, fan_out):
            super().__init__()
            self.weight = Parameter(Tensor(rng.normal(0, fan_in ** -0.5, (fan_out, fan_in)).astype(np.float32)))
            self.bias = Parameter(Tensor(np.zeros(fan_out, np.float32)))

        def construct(self, x):
            return (matmul_nt(x.reshape(-1, x.shape[-1]), self.weight) + self.bias).reshape(
                x.shape[:-1] + (self.weight.shape[0],))

    def layer_norm(x):
        centred = x - x.mean(-1, keep_dims=True)
        return centred * ops.rsqrt((centred * centred).mean(-1, keep_dims=True) + 1e-6)

    def rms_norm(x, weight):
        return x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + 1e-6) * weight

    class Attention(nn.Cell):
        def __init__(self):
            super().__init__()
            self.to_q, self.to_k, self.to_v, self.to_out = (Linear(DIM, DIM) for _ in range(4))
            self.norm_q = Parameter(Tensor(np.ones(DIM, np.float32)))
            self.norm_k = Parameter(Tensor(np.ones(DIM, np.float32)))

        def construct(self, x, context):
            batch, rows, keys, head_dim = x.shape[0], x.shape[1], context.shape[1], DIM // HEADS
            q = rms_norm(self.to_q(x), self.norm_q).reshape(batch, rows, HEADS, head_dim).transpose(0, 2, 1, 3)
            k = rms_norm(self.to_k(context), self.norm_k).reshape(batch, keys, HEADS, head_dim).transpose(0, 2, 1, 3)
            v = self.to_v(context).reshape(batch, keys, HEADS, head_dim).transpose(0, 2, 1, 3)
            probs = ops.softmax(ops.matmul(q * head_dim ** -0.5, k.transpose(0, 1, 3, 2)), -1)
            return self.to_out(ops.matmul(probs, v).transpose(0, 2, 1, 3).reshape(batch, rows, DIM))

    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            self.attn1, self.attn2 = Attention(), Attention()
            self.ffn_in, self.ffn_out = Linear(DIM, FFN), Linear(FFN, DIM)
            self.table = Parameter(Tensor(rng.normal(0, DIM ** -0.5, (1, 6, DIM)).astype(np.float32)))

        def construct(self, x, context, modulation):
            shift, scale, gate, c_shift, c_scale, c_gate = ops.split(self.table + modulation, 1, 1)
            h = layer_norm(x) * (1 + scale) + shift
            x = x + self.attn1(h, h) * gate
            x = x + self.attn2(layer_norm(x), context)
            h = layer_norm(x) * (1 + c_scale) + c_shift
            return x + self.ffn_out(ops.gelu(self.ffn_in(h), approximate="tanh")) * c_gate

    return Block()


def train_steps(tokens):
    """{name: fn(x, context, modulation) -> (loss, grads)} for the plain block eager, the plain
    block under ms.jit, and mm's Wan block eager."""
    import mindspore as ms

    from mm_models_video.wan.config import WanTransformerConfig
    from mm_models_video.wan.transformer import WanTransformerBlock
    from mm_parallel.config import ParallelConfig
    from mm_parallel.topology import Topology

    eager, compiled = plain_block(), plain_block()
    config = WanTransformerConfig(num_attention_heads=HEADS, attention_head_dim=DIM // HEADS, ffn_dim=FFN,
                                  num_layers=1, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6)
    ours = WanTransformerBlock(config, Topology.build(ParallelConfig(), 1, 0))
    rng = np.random.default_rng(1)
    cos, sin = (ms.Tensor(rng.standard_normal((tokens, DIM // HEADS)).astype(np.float32)) for _ in range(2))

    @ms.jit
    def compiled_block(x, context, modulation):
        return compiled(x, context, modulation)

    forwards = {
        "plain MindSpore, PyNative": (eager, eager),
        "plain MindSpore, ms.jit": (compiled, compiled_block),
        "mm Wan block, PyNative": (ours, lambda x, context, modulation: ours(x, context, None, modulation, cos, sin)),
    }
    steps = {}
    for name, (cell, forward) in forwards.items():
        def loss(x, context, modulation, forward=forward):
            return (forward(x, context, modulation) ** 2).mean()
        steps[name] = ms.value_and_grad(loss, None, cell.trainable_params())
    return steps


def time_steps(steps, inputs, runs):
    """(first call seconds (compiles under ms.jit), median seconds of ``runs`` alternating calls) per step."""
    first, times = {}, {name: [] for name in steps}
    for name, step in steps.items():
        start = time.perf_counter()
        step(*inputs)[0].asnumpy()
        first[name] = time.perf_counter() - start
    for _ in range(runs):
        for name, step in steps.items():
            start = time.perf_counter()
            loss, grads = step(*inputs)
            grads[0].asnumpy()
            times[name].append(time.perf_counter() - start)
    return {name: (first[name], statistics.median(times[name])) for name in steps}


def shared_written_backward_error():
    """(max |jit - eager|, max |eager - exact|) of d/dx sum(f(1.5 x) * f(2 x)) with f(x) = 3 x a
    Cell whose backward is written out (dx = 3 dy), one instance serving both calls."""
    import mindspore as ms
    from mindspore import Tensor, nn

    class Triple(nn.Cell):
        def construct(self, x):
            return x * 3

        def bprop(self, x, out, dout):
            return (dout * 3,)

    triple = Triple()

    def f(x):
        return (triple(x * 1.5) * triple(x * 2.0)).sum()

    x = np.arange(8, dtype=np.float32).reshape(2, 4) / 7
    eager = ms.grad(f)(Tensor(x)).asnumpy()
    compiled = ms.grad(ms.jit(f))(Tensor(x)).asnumpy()
    exact = 2 * 9 * 1.5 * 2.0 * x
    return float(np.abs(compiled - eager).max()), float(np.abs(eager - exact).max())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048, help="video tokens of the block's input")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    import mindspore as ms
    from mindspore import Tensor

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    rng = np.random.default_rng(0)
    inputs = tuple(Tensor(rng.standard_normal(shape).astype(np.float32))
                   for shape in ((1, args.tokens, DIM), (1, TEXT, DIM), (1, 6, DIM)))
    results = time_steps(train_steps(args.tokens), inputs, args.runs)
    reference = results["mm Wan block, PyNative"][1]
    print(f"One DiT block forward + backward, {args.tokens} tokens, dim {DIM}, FFN {FFN}, {TEXT} text tokens "
          f"(median of {args.runs})")
    print(f"{'':28} {'first call s':>12} {'step s':>8} {'ratio to mm eager':>18}")
    for name, (first, median) in results.items():
        print(f"{name:28} {first:12.2f} {median:8.3f} {median / reference:18.2f}")
    plain_eager, plain_jit = results["plain MindSpore, PyNative"][1], results["plain MindSpore, ms.jit"][1]
    print(f"ms.jit speed-up on the plain block: {plain_eager / plain_jit:.2f}x")
    jit_error, eager_error = shared_written_backward_error()
    print(f"written-backward Cell called twice, gradient error: ms.jit {jit_error:.3g}, PyNative {eager_error:.3g}"
          f" ({'wrong' if jit_error > 1e-3 else 'right'} under ms.jit)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
