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
    from mindspore import Tensor

    from reference_model import H

    rng = np.random.default_rng(13)
    lengths = [S + 4 * (i % 2) if vary else S for i in range(MICRO)]
    return [tuple(Tensor(rng.standard_normal((MB, n, H)).astype(np.float32)) for _ in range(2)) for n in lengths]


def loss_fn(y, c):
    return (y * c).sum()


def run_pipeline_cases(layouts, layers=4):
    """layouts: {name: {"layout": ParallelConfig kwargs, "vpp": chunks (interleaved when > 1),
    "layers": count, "pipeline_num_layers": counts or None, "vary": bool}} -> {name: [problems]}."""
    import mindspore as ms

    import mm_parallel
    from mm_parallel import ParallelConfig
    from mm_parallel.optimizer import DistributedOptimizer, OptimizerConfig
    from mm_parallel.pipeline import stage_layer_ranges, train_step_1f1b, train_step_interleaved
    from mm_parallel.topology import Topology
    from reference_model import build_stack, full_arrays, run_stack

    solo = Topology.build(ParallelConfig(), 1, 0)
    results = {}
    for name, case in layouts.items():
        try:
            n_layers = case.get("layers", layers)
            data = micro_batches(case.get("vary", False))
            # reference: one process, the mean loss over all micro-batches differentiated at once
            ref = build_stack(solo, layers=n_layers)
            ref_opt = DistributedOptimizer(ref, OptimizerConfig(**CFG), solo)

            def ref_step():
                losses = [float(loss_fn(run_stack(ref, x), c).asnumpy()) for x, c in data]
                mean_loss = lambda: sum(loss_fn(run_stack(ref, x), c) for x, c in data) / len(data)
                return losses, ms.grad(mean_loss, None, ref.trainable_params())()

            topo = mm_parallel.initialize(ParallelConfig(**case["layout"]))
            stack = build_stack(topo, layers=n_layers)
            vpp = case.get("vpp", 1)
            ranges = stage_layer_ranges(n_layers, topo.pp.size, vpp, case.get("pipeline_num_layers"))
            chunks = [[stack[i] for i in ranges[c][topo.pp.rank]] for c in range(vpp)]
            blocks = [b for chunk in chunks for b in chunk]
            params = [p for b in blocks for p in b.trainable_params()]
            opt = DistributedOptimizer(blocks, OptimizerConfig(**CFG), topo)

            def step():
                if vpp == 1:
                    return train_step_1f1b(lambda t: run_stack(blocks, t), params, data, loss_fn, topo)
                fns = [lambda t, chunk=chunk: run_stack(chunk, t) for chunk in chunks]
                chunk_params = [[p for b in chunk for p in b.trainable_params()] for chunk in chunks]
                losses, chunk_grads = train_step_interleaved(fns, chunk_params, data, loss_fn, topo)
                return losses, [g for c in chunk_grads for g in c]

            problems = []
            for k in range(STEPS):  # each step: losses, (first step) gradients, the global norm
                ref_losses, ref_grads = ref_step()
                losses, grads = step()
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
            ref_params = full_arrays(ref, solo, ref.trainable_params(), ref.trainable_params())
            for key, value in full_arrays(stack, topo, params, params).items():
                if not np.allclose(value, ref_params[key], rtol=1e-4, atol=1e-5):
                    problems.append(f"param {key} after {STEPS} steps max err {np.abs(value - ref_params[key]).max()}")
            results[name] = problems
        except Exception:
            results[name] = [traceback.format_exc()]
    return results
