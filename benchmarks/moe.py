"""MoE: token dispatch all-to-all vs all-gather, grouped experts vs a loop over experts, and the
load balance a skewed router reaches with no balancing, the aux loss, or the expert bias.

    python benchmarks/moe.py [--nproc 2 4] [--tokens 256 1024 4096] [--steps 50]

1. Dispatch: one MoE layer's dispatch + combine (forward, then backward of their sum), the expert
   compute replaced by a gather so the figure is the exchange's own; median of --rounds on rank 0,
   per ep size and token count per rank (H 256, 8 experts, top 2), both dispatchers side by side.
2. Grouped experts: forward + backward of E_local experts over 2048 routed rows, the batched
   matmul against a Python loop over experts; the ratio loop / grouped.
3. Balance: a router whose weights favour expert 0, trained 50 steps (AdamW, lr 1e-2) on a
   regression target; imbalance = max / mean tokens per expert at steps 1, 10, 50, with no
   balancing, aux_loss_coef 0.1, and the expert bias (rates 0.01 and 0.05).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

H, E, K = 256, 8, 2


def dispatch_times(tokens, rounds):
    """Runs on every rank: {dispatcher: {T: median seconds of dispatch + combine, forward and backward}}."""
    import mindspore as ms
    from mindspore import Tensor, ops

    import mm_parallel
    from mm_parallel import ParallelConfig
    from mm_parallel.moe import MoEConfig, TopKRouter
    from mm_parallel.moe.dispatch import DISPATCHERS

    world = mm_parallel.initialize(ParallelConfig()).world_size
    topo = mm_parallel.initialize(ParallelConfig(ep=world))  # every rank one expert group
    router = TopKRouter(MoEConfig(hidden_size=H, moe_intermediate_size=H, num_experts=E, top_k=K), 1.0)
    out = {}
    for name, cls in DISPATCHERS.items():
        dispatcher, out[name] = cls(E, topo), {}
        for count in tokens:
            x = Tensor(np.random.default_rng([topo.rank, count]).standard_normal((count, H)).astype(np.float32))
            routing = router(x)

            def step(x):
                received, groups, state = dispatcher.dispatch(x, routing)
                rows = ops.gather(received, Tensor(groups.padded.astype(np.int32)), 0)
                return dispatcher.combine(ops.concat([rows, ops.zeros((1, H), ms.float32)]), state).sum()

            times = []
            for _ in range(rounds):
                mm_parallel.comm.barrier(topo.world)
                start = time.perf_counter()
                ms.grad(step)(x).asnumpy()
                times.append(time.perf_counter() - start)
            out[name][str(count)] = statistics.median(times)
    return out


def grouped_vs_loop(rounds):
    import mindspore as ms
    from mindspore import Tensor

    from mm_parallel.moe import GroupedExperts
    from mm_parallel.moe.token_layout import expert_groups

    rows = 2048
    print(f"\n2. grouped experts, {rows} routed rows, H {H}, I 512, forward + backward, median of {rounds}")
    print(f"{'experts':>8} {'grouped s':>10} {'loop s':>10} {'loop / grouped':>15}")
    for local in (4, 16):
        experts = GroupedExperts(local, H, 512)
        rng = np.random.default_rng(local)
        tokens = Tensor(np.concatenate([rng.standard_normal((rows, H)), np.zeros((1, H))]).astype(np.float32))
        groups = expert_groups(np.append(rng.integers(0, local, rows), -1), local, sink=rows)
        params = experts.trainable_params()
        timing = {}
        for label, fn in (("grouped", experts.construct), ("loop", experts.per_expert_loop)):
            times = []
            for _ in range(rounds + 1):
                start = time.perf_counter()
                grads = ms.grad(lambda t: fn(t, groups).sum(), None, params)(tokens)
                grads[0].asnumpy()
                times.append(time.perf_counter() - start)
            timing[label] = statistics.median(times[1:])
        grouped, loop = timing["grouped"], timing["loop"]
        print(f"{local:>8} {grouped:>10.4f} {loop:>10.4f} {loop / grouped:>15.2f}")


def balance(steps):
    import mindspore as ms
    from mindspore import Tensor

    from mm_parallel.moe import MoEConfig, MoELayer, auxiliary_loss, routing_metrics, update_expert_biases
    from mm_parallel.optimizer import DistributedOptimizer, OptimizerConfig

    print(f"\n3. imbalance (max / mean tokens per expert) of a skewed router, 256 tokens, {E} experts, top {K}")
    print(f"{'method':>12} " + " ".join(f"{'step ' + str(s):>9}" for s in (1, 10, steps)))
    rng = np.random.default_rng(0)
    x = Tensor(np.abs(rng.standard_normal((256, 32))).astype(np.float32))
    target = Tensor(rng.standard_normal((256, 32)).astype(np.float32))
    for label, options in (("none", {}), ("aux 0.1", {"aux_loss_coef": 0.1}),
                           ("bias 0.01", {"expert_bias": True, "bias_update_rate": 0.01}),
                           ("bias 0.05", {"expert_bias": True, "bias_update_rate": 0.05})):
        layer = MoELayer(MoEConfig(hidden_size=32, moe_intermediate_size=16, num_experts=E, top_k=K, **options))
        skew = np.random.default_rng(1).standard_normal((E, 32)).astype(np.float32) * 0.1
        skew[0] += 0.15  # expert 0 first for every token, its softmax weight ~0.5
        layer.gate.weight.set_data(Tensor(skew))
        opt = DistributedOptimizer(layer, OptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=0.0))
        params, seen = layer.trainable_params(), {}

        def loss():
            y = layer(x)
            return ((y - target) ** 2).mean() + auxiliary_loss([layer])

        for step in range(1, steps + 1):
            opt.step(ms.grad(loss, None, params)())
            update_expert_biases(layer)
            if step in (1, 10, steps):
                seen[step] = routing_metrics(layer)["moe"]["imbalance"]
            else:
                routing_metrics(layer)
        print(f"{label:>12} " + " ".join(f"{seen[s]:>9.2f}" for s in (1, 10, steps)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    from mm_parallel.launch import run_distributed

    print(f"1. dispatch + combine, forward and backward, H {H}, {E} experts, top {K}; median of {args.rounds} (rank 0)")
    print(f"{'ep':>3} {'tokens':>7} {'alltoall s':>11} {'allgather s':>12} {'allgather / alltoall':>21}")
    for nproc in args.nproc:
        result = run_distributed(dispatch_times, nproc=nproc, timeout=900, tokens=args.tokens, rounds=args.rounds)[0]
        for count in args.tokens:
            a2a, ag = result["alltoall"][str(count)], result["allgather"][str(count)]
            print(f"{nproc:>3} {count:>7} {a2a:>11.3f} {ag:>12.3f} {ag / a2a:>21.2f}")
    grouped_vs_loop(args.rounds)
    balance(args.steps)


if __name__ == "__main__":
    main()
