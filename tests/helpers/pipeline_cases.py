"""1F1B and interleaved (VPP) pipelines on the reference stack, three DistributedOptimizer steps
under a layout against one process on the same micro-batches: losses per micro-batch and global
norm each step, first-step gathered gradients, final parameters."""

from __future__ import annotations

import traceback

import numpy as np

MICRO, MB, S = 4, 1, 8  # micro-batches, micro-batch size, sequence (varied per micro-batch)
STEPS = 3
CFG = {"lr": 1e-2, "weight_decay": 0.1, "clip_grad": 5.0}


def micro_batches(vary):
    from helpers.reference_model import H
    from mindspore import Tensor

    rng = np.random.default_rng(13)
    lengths = [S + 4 * (i % 2) if vary else S for i in range(MICRO)]
    return [tuple(Tensor(rng.standard_normal((MB, n, H)).astype(np.float32)) for _ in range(2)) for n in lengths]


def loss_fn(y, c):
    return (y * c).sum()


def dict_stage(blocks, x, last: bool):
    """A stage passing a dict of float32, bfloat16 and int64 tensors (shapes follow the
    micro-batch): it takes h + 0.5 * scale where ids > 0, runs its blocks, and sends h, a bf16
    scale made from it and int64 ids (the last stage returns h)."""
    import mindspore as ms
    from helpers.reference_model import run_stack
    from mindspore import Tensor, ops

    if isinstance(x, dict):
        keep = (x["ids"] > 0).astype(ms.float32)[..., None]
        x = x["h"] + 0.5 * x["scale"].astype(ms.float32) * keep
    h = run_stack(blocks, x)
    if last:
        return h
    batch, seq = h.shape[:2]
    ids = Tensor(np.tile(np.arange(seq) % 3, (batch, 1)).astype(np.int64))
    return {"h": h, "scale": ops.tanh(h.mean(axis=1, keep_dims=True)).astype(ms.bfloat16), "ids": ids}


def virtual_stages(blocks, ranges):
    """The whole stack cut into its virtual stages, in pipeline order (chunk c of stage s is c pp + s)."""
    return [[blocks[i] for i in stage] for chunk in ranges for stage in chunk]


def run_pipeline_cases(layouts, layers=4):
    """layouts: {name: {"layout": ParallelConfig kwargs, "vpp": chunks (interleaved when > 1),
    "layers": count, "pipeline_num_layers": counts or None, "vary": bool, "dict_io": stages pass
    `dict_stage`'s dicts, "plan": the steps share a stage_io.TransferPlan (headers cross in the
    first step only: checked)}} -> {name: [problems]}."""
    import mindspore as ms
    from helpers.reference_model import build_stack, full_arrays, run_stack

    import mm_parallel
    from mm_parallel import ParallelConfig
    from mm_parallel.optimizer import DistributedOptimizer, OptimizerConfig
    from mm_parallel.pipeline import stage_layer_ranges, train_step_1f1b, train_step_interleaved
    from mm_parallel.stage_io import TransferPlan
    from mm_parallel.topology import Topology

    solo = Topology.build(ParallelConfig(), 1, 0)
    results = {}
    for name, case in layouts.items():
        try:
            n_layers = case.get("layers", layers)
            data = micro_batches(case.get("vary", False))
            # reference: one process, the mean loss over all micro-batches differentiated at once
            ref = build_stack(solo, layers=n_layers)
            ref_opt = DistributedOptimizer(ref, OptimizerConfig(**CFG), solo)

            topo = mm_parallel.initialize(ParallelConfig(**case["layout"]))
            vpp, dict_io = case.get("vpp", 1), case.get("dict_io", False)
            ranges = stage_layer_ranges(n_layers, topo.pp.size, vpp, case.get("pipeline_num_layers"))
            last_stage = topo.pp.size * vpp - 1

            def run(blocks, x, virtual):
                return dict_stage(blocks, x, virtual == last_stage) if dict_io else run_stack(blocks, x)

            def whole(x):  # the reference: every virtual stage in turn on one process
                for virtual, blocks in enumerate(virtual_stages(ref, ranges)):
                    x = run(blocks, x, virtual)
                return x

            def ref_step():
                losses = [float(loss_fn(whole(x), c).asnumpy()) for x, c in data]
                mean_loss = lambda: sum(loss_fn(whole(x), c) for x, c in data) / len(data)
                return losses, ms.grad(mean_loss, None, ref.trainable_params())()

            stack = build_stack(topo, layers=n_layers)
            chunks = [[stack[i] for i in ranges[c][topo.pp.rank]] for c in range(vpp)]
            blocks = [b for chunk in chunks for b in chunk]
            params = [p for b in blocks for p in b.trainable_params()]
            opt = DistributedOptimizer(blocks, OptimizerConfig(**CFG), topo)
            plan = TransferPlan() if case.get("plan") else None

            def step():
                if vpp == 1:
                    return train_step_1f1b(lambda t: run(blocks, t, topo.pp.rank), params, data, loss_fn, topo,
                                           plan=plan)
                fns = [lambda t, c=c, chunk=chunk: run(chunk, t, c * topo.pp.size + topo.pp.rank)
                       for c, chunk in enumerate(chunks)]
                chunk_params = [[p for b in chunk for p in b.trainable_params()] for chunk in chunks]
                losses, chunk_grads = train_step_interleaved(fns, chunk_params, data, loss_fn, topo, plan=plan)
                return losses, [g for c in chunk_grads for g in c]

            problems, handshakes = [], []
            for k in range(STEPS):  # each step: losses, (first step) gradients, the global norm
                ref_losses, ref_grads = ref_step()
                losses, grads = step()
                handshakes.append(plan.handshakes if plan is not None else 0)
                if topo.pp.rank == topo.pp.size - 1 and not np.allclose(losses, ref_losses, rtol=1e-5):
                    problems.append(f"step {k} losses {losses} != {ref_losses}")
                if k == 0:
                    ref_full = full_arrays(ref, solo, ref.trainable_params(), ref_grads)
                    got = full_arrays(stack, topo, params, grads)
                    for key, g in got.items():
                        if not np.allclose(g, ref_full[key], rtol=1e-4, atol=1e-5):
                            problems.append(f"grad {key} max err {np.abs(g - ref_full[key]).max()}")
                    if len(got) != len(params) or not got:
                        problems.append("no gradients compared")
                # the optimizer's global norm spans the stages (tp-replicated values counted once)
                norm, ref_norm = opt.step(grads)["grad_norm"], ref_opt.step(ref_grads)["grad_norm"]
                if not np.isclose(norm, ref_norm, rtol=1e-5):
                    problems.append(f"step {k} grad norm {norm} != {ref_norm}")
            if plan is not None and not (handshakes[0] > 0 and handshakes[-1] == handshakes[0]):
                problems.append(f"headers crossed after the first step: {handshakes} (cumulative per step)")
            ref_params = full_arrays(ref, solo, ref.trainable_params(), ref.trainable_params())
            for key, value in full_arrays(stack, topo, params, params).items():
                if not np.allclose(value, ref_params[key], rtol=1e-4, atol=1e-5):
                    problems.append(f"param {key} after {STEPS} steps max err {np.abs(value - ref_params[key]).max()}")
            results[name] = problems
        except Exception:
            results[name] = [traceback.format_exc()]
    return results
