"""A toy expert layer under ep=2 inside dp=4 (expert-data-parallel groups of 2) against one
process: loading each rank's experts from a Hugging Face folder, two optimizer steps with ZeRO-1
over expert-dp, saving the model and the optimizer, and resuming the third step under ep=1.

The toy: a dense weight W (H, H) on every rank and E experts (E, H, H) split over ep on dim 0.
Data-parallel rank d computes L_d = sum(tanh(x_d W) @ sum of the experts of ep rank d mod 2), the
experts ep rank d mod 2 holds under ep=2; the model's loss is mean over d of L_d. One process
computes that mean with all experts in one place."""

from __future__ import annotations

import os
import traceback

import numpy as np

H, EXPERTS, DP, STEPS = 8, 4, 4, 3
CFG = {"lr": 5e-2, "weight_decay": 0.1, "clip_grad": 0.5}


def full_weights():
    rng = np.random.default_rng(5)
    return {"dense.weight": (rng.standard_normal((H, H)) * 0.3).astype(np.float32),
            "experts.weight": (rng.standard_normal((EXPERTS, H, H)) * 0.3).astype(np.float32)}


def batch(step, d):
    return np.random.default_rng([step, d]).standard_normal((3, H)).astype(np.float32)


def build(topo):
    from mindspore import Parameter, Tensor, nn

    from mm_parallel.sharding import split

    class Toy(nn.Cell):
        def __init__(self):
            super().__init__()
            self.topology = topo
            self.dense = nn.Cell()
            self.dense.weight = Parameter(Tensor(np.zeros((H, H), np.float32)), name="dense.weight")
            self.experts = nn.Cell()
            local = EXPERTS // topo.ep.size
            self.experts.weight = split(Parameter(Tensor(np.zeros((local, H, H), np.float32)), name="experts.weight"),
                                        (0, "ep"), grad_sync="edp")

    return Toy()


def loss_of(model, x, first_expert, count, offset):
    """L = sum(tanh(x W) @ sum of experts [first, first + count)), ``offset``: the model's first local expert."""
    from mindspore import Tensor, ops

    h = ops.tanh(ops.matmul(Tensor(x), model.dense.weight))
    local = model.experts.weight[first_expert - offset:first_expert - offset + count].sum(0)
    return ops.matmul(h, local).sum()


def _subset(d):
    per = EXPERTS // 2  # the experts ep rank d mod 2 holds under ep=2
    return (d % 2) * per, per


def one_process():
    """Full parameters after each step and the grad norms, on one process."""
    import mindspore as ms
    from mindspore import Tensor

    from mm_parallel import ParallelConfig
    from mm_parallel.optimizer import DistributedOptimizer, OptimizerConfig
    from mm_parallel.topology import Topology

    solo = Topology.build(ParallelConfig(), 1, 0)
    model = build(solo)
    for name, value in full_weights().items():
        dict(model.parameters_and_names())[name].set_data(Tensor(value))
    opt = DistributedOptimizer(model, OptimizerConfig(**CFG), solo)
    params, history, norms = model.trainable_params(), [], []
    for step in range(STEPS):
        mean = lambda: sum(loss_of(model, batch(step, d), *_subset(d), 0) for d in range(DP)) / DP
        grads = ms.grad(mean, None, params)()
        norms.append(opt.step(grads)["grad_norm"])
        history.append({p.name: p.asnumpy().copy() for p in params})
    return history, norms


def run_sharding_cases(root):
    """-> [problems] of this rank."""
    import mindspore as ms
    from safetensors.numpy import load_file

    import mm_parallel
    from mm_parallel import ParallelConfig, comm
    from mm_parallel.hf_checkpoint import full_state, load_weights, write_weights
    from mm_parallel.optimizer import DistributedOptimizer, OptimizerConfig
    from mm_parallel.sharding import sharding_of

    problems = []
    try:
        history, norms = one_process()
        folder, saved = os.path.join(root, "hf"), os.path.join(root, "saved")
        topo = mm_parallel.initialize(ParallelConfig(ep=2))
        if topo.rank == 0:
            write_weights(full_weights(), folder)
        comm.barrier(topo.world)

        def run(topo, steps, source, opt_state=None):
            model = build(topo)
            load_weights(model, source)
            opt = DistributedOptimizer(model, OptimizerConfig(**CFG), topo, zero_stage=1)
            if opt_state:
                opt.load(opt_state)
            params, d = model.trainable_params(), topo.dp.rank
            offset = topo.ep.rank * (EXPERTS // topo.ep.size)
            got = []
            for step in steps:
                grads = ms.grad(lambda: loss_of(model, batch(step, d), *_subset(d), offset), None, params)()
                got.append(opt.step(grads)["grad_norm"])
            return model, opt, got

        def compare(model, topo, want, what):
            for name, value in full_state(model).items():
                if not np.allclose(value, want[name], rtol=1e-5, atol=1e-6):
                    problems.append(f"{what}: {name} max err {np.abs(value - want[name]).max()}")

        model, _, _ = run(topo, [], folder)  # load: this rank's experts
        first = topo.ep.rank * (EXPERTS // 2)
        if not np.array_equal(model.experts.weight.asnumpy(), full_weights()["experts.weight"][first:first + 2]):
            problems.append("ep=2: the loaded experts are not this ep rank's slice")
        if sharding_of(model.experts.weight).grad_sync != "edp" or topo.edp.size != 2:
            problems.append(f"experts sync over edp of 2 ranks, got {topo.edp.size}")
        model, opt, got = run(topo, range(2), folder)  # two steps, ZeRO-1 over edp
        if not np.allclose(got, norms[:2], rtol=1e-5):
            problems.append(f"ep=2 grad norms {got} != {norms[:2]}")
        compare(model, topo, history[1], "ep=2 after two steps")
        if opt.buckets["edp.0"].shards != 2:
            problems.append("the experts' optimizer state is not sharded over expert-dp")
        state = full_state(model)  # save: the model (experts gathered over ep) and the optimizer
        if topo.rank == 0:
            write_weights(state, saved)
        opt.save(saved)
        on_disk = load_file(os.path.join(saved, "model.safetensors"))
        for name, want in history[1].items():  # what was saved is the one-process model after two steps
            if not np.allclose(on_disk[name], want, rtol=1e-5, atol=1e-6):
                problems.append(f"saved {name} differs from one process")
        topo = mm_parallel.initialize(ParallelConfig(ep=1))  # resume under ep=1: every expert on every rank
        model, _, got = run(topo, [2], saved, opt_state=saved)
        if not np.allclose(got, norms[2:], rtol=1e-5):
            problems.append(f"resumed ep=1 grad norm {got} != {norms[2:]}")
        compare(model, topo, history[2], "resumed ep=1, third step")
    except Exception:
        problems.append(traceback.format_exc())
    return problems
