"""DistributedOptimizer on the reference stack: three steps under a layout (dp2 with zero 0/1/2,
dp2 x tp2, ...) against one process on the whole batch, plus a numpy AdamW written here."""

from __future__ import annotations

import os
import traceback

import numpy as np

STEPS, B, S = 3, 4, 8  # B: the global batch, split over dp


def batches():
    from helpers.reference_model import H

    rng = np.random.default_rng(9)
    return [tuple(rng.standard_normal((B, S, H)).astype(np.float32) for _ in range(2)) for _ in range(STEPS)]


def numpy_adamw(params, grads_per_step, decayed, cfg):
    """Reference: global-norm clipping then AdamW, in float64 numpy. params: {name: array}."""
    params = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in params.items()}
    v2 = {k: np.zeros_like(v) for k, v in params.items()}
    b1, b2 = cfg["betas"]
    norms = []
    for t, grads in enumerate(grads_per_step, 1):
        norm = np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in grads.values()))
        norms.append(norm)
        coef = min(1.0, cfg["clip_grad"] / (norm + 1e-6))
        for k in params:
            g = grads[k] * coef
            m[k] = b1 * m[k] + (1 - b1) * g
            v2[k] = b2 * v2[k] + (1 - b2) * g * g
            wd = cfg["weight_decay"] if decayed[k] else 0.0
            params[k] = params[k] * (1 - cfg["lr"] * wd) - cfg["lr"] * (m[k] / (1 - b1 ** t)) / (
                np.sqrt(v2[k] / (1 - b2 ** t)) + cfg["eps"])
    return params, norms


def dp_slice(t, topo):
    """This dp rank's rows of a global (B, ...) batch, then the cp / sp sequence slice."""
    from helpers.reference_model import local_slice

    per = t.shape[0] // topo.dp.size
    return local_slice(t[topo.dp.rank * per:(topo.dp.rank + 1) * per], topo)


def train(topo, zero_stage, cfg, data, save_dir=None, load_dir=None):
    """(losses, grad norms, final full parameters, optimizer) after one optimizer step per batch
    of ``data``; the state is saved after the second step to ``save_dir`` and, with ``load_dir``,
    read before the first."""
    import mindspore as ms
    from helpers.reference_model import build_stack, full_arrays, run_stack
    from mindspore import Tensor

    from mm_parallel import comm
    from mm_parallel.optimizer import DistributedOptimizer, OptimizerConfig

    stack = build_stack(topo)
    if zero_stage == 3:  # every linear weight cut into flat slices (the reference stack's are small)
        from mm_parallel.zero3 import GATHERS, shard_parameters

        shard_parameters(stack, topo, min_numel=1)
        GATHERS.clear()
    opt = DistributedOptimizer(stack, OptimizerConfig(**cfg), topo, zero_stage=zero_stage)
    params = stack.trainable_params()
    if load_dir:
        opt.load(load_dir)
    losses, norms = [], []
    for i, (x, c) in enumerate(data):
        xl, cl = dp_slice(Tensor(x), topo), dp_slice(Tensor(c), topo)
        local_batch = xl.shape[0]
        loss, grads = ms.value_and_grad(lambda t: (run_stack(stack, t) * cl).sum() / local_batch, None, params)(xl)
        # the loss a person reads: summed over the sequence shards, averaged over dp
        for group in (topo.cp, topo.tp if topo.config.sequence_parallel else None):
            if group is not None and group.size > 1:
                loss = comm.all_reduce(loss, group)
        if topo.dp.size > 1:
            loss = comm.all_reduce(loss, topo.dp) / topo.dp.size
        info = opt.step(grads)
        losses.append(float(loss.asnumpy()))
        norms.append(info["grad_norm"])
        if save_dir and i == 1:
            opt.save(save_dir)
    return losses, norms, full_arrays(stack, topo, params, params), opt


def zero3_problems(opt, topo, steps: int):
    """Under ZeRO-3 every linear weight is held as its 1/D flat slice, gathered once in each
    step's forward and once in its backward (kept from the forward without reshard_after_forward),
    no more."""
    from mm_parallel.sharding import sharding_of
    from mm_parallel.zero3 import GATHERS

    problems, flat = [], [p for p in opt.params if sharding_of(p).flat_over]
    if not flat:
        return ["no weight was sharded"]
    shards = topo.dp_cp_shard.size  # the dp x cp ranks, or under hybrid sharding those of a node
    for p in flat:
        whole = int(np.prod(sharding_of(p).local_shape))
        if p.shape != (-(-whole // shards),):
            problems.append(f"{p.name}: {p.shape} is not 1/{shards} of {whole} values")
    kept = not topo.config.reshard_after_forward  # one gather per weight and step, kept for its backward
    if dict(GATHERS) != {"forward": len(flat) * steps, **({} if kept else {"backward": len(flat) * steps})}:
        problems.append(f"gathers {dict(GATHERS)} for {len(flat)} sharded weights over the steps")
    return problems


CFG = {"lr": 1e-2, "weight_decay": 0.1, "clip_grad": 0.5, "betas": (0.9, 0.95), "eps": 1e-8}


def run_optimizer_cases(layouts, save_root):
    """layouts: {name: {"layout": ParallelConfig kwargs, "zero": stage, "resume": earlier name,
    "optim": OptimizerConfig fields over CFG}}
    -> {name: [problems]}. A resuming case loads the state the earlier case saved after two steps
    (another dp size or stage allowed) and takes the third step."""
    import mm_parallel
    from mm_parallel import ParallelConfig
    from mm_parallel.topology import Topology

    solo = Topology.build(ParallelConfig(), 1, 0)
    data = batches()
    ref_losses, ref_norms, ref_params, _ = train(solo, 0, CFG, data)
    results = {}
    for name, case in layouts.items():
        try:
            topo = mm_parallel.initialize(ParallelConfig(**case["layout"]))
            cfg = dict(CFG, **case.get("optim", {}))  # e.g. small buckets, cutting through parameters
            if "resume" in case:
                first = STEPS - 1
                load_dir = os.path.join(save_root, case["resume"])
                losses, norms, params, opt = train(topo, case["zero"], cfg, data[first:], load_dir=load_dir)
            else:
                first = 0
                losses, norms, params, opt = train(topo, case["zero"], cfg, data, os.path.join(save_root, name))
            problems = []
            if not np.allclose(losses, ref_losses[first:], rtol=1e-5):
                problems.append(f"losses {losses} != {ref_losses[first:]}")
            if not np.allclose(norms, ref_norms[first:], rtol=1e-4):
                problems.append(f"grad norms {norms} != {ref_norms[first:]}")
            for key, want in ref_params.items():
                if not np.allclose(params[key], want, rtol=1e-4, atol=1e-5):
                    problems.append(f"param {key} max err {np.abs(params[key] - want).max()}")
            if case["zero"] in (1, 2) and opt.state_bytes() > 3 * 4 * (opt.numel // topo.dp_cp.size + topo.dp_cp.size):
                problems.append(f"state bytes {opt.state_bytes()} is not about 1/{topo.dp_cp.size} of the full state")
            problems += zero3_problems(opt, topo, STEPS - first) if case["zero"] == 3 else []
            if case.get("optim", {}).get("bucket_numel") and len(opt.buckets) < 3:
                problems.append(f"{len(opt.buckets)} buckets: the case means to cut the parameters into several")
            results[name] = problems
        except Exception:
            results[name] = [traceback.format_exc()]
    return results
