"""1F1B and interleaved (VPP) pipelines on the reference stack: loss per micro-batch and gathered gradients under a
layout against one process accumulating the same micro-batches."""

from __future__ import annotations

import traceback

import numpy as np

MICRO, MB, S = 4, 1, 8  # micro-batches, micro-batch size, sequence (varied per micro-batch)


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
            ref_losses = [float(loss_fn(run_stack(ref, x), c).asnumpy()) for x, c in data]
            mean_loss = lambda: sum(loss_fn(run_stack(ref, x), c) for x, c in data) / len(data)
            ref_grads = ms.grad(mean_loss, None, ref.trainable_params())()
            ref_full = full_arrays(ref, solo, ref.trainable_params(), ref_grads)

            topo = mm_parallel.initialize(ParallelConfig(**case["layout"]))
            stack = build_stack(topo, layers=n_layers)
            vpp = case.get("vpp", 1)
            ranges = stage_layer_ranges(n_layers, topo.pp.size, vpp, case.get("pipeline_num_layers"))
            chunks = [[stack[i] for i in ranges[c][topo.pp.rank]] for c in range(vpp)]
            blocks = [b for chunk in chunks for b in chunk]
            params = [p for b in blocks for p in b.trainable_params()]
            if vpp == 1:
                losses, grads = train_step_1f1b(lambda t: run_stack(blocks, t), params, data, loss_fn, topo)
            else:
                fns = [lambda t, chunk=chunk: run_stack(chunk, t) for chunk in chunks]
                chunk_params = [[p for b in chunk for p in b.trainable_params()] for chunk in chunks]
                losses, chunk_grads = train_step_interleaved(fns, chunk_params, data, loss_fn, topo)
                grads = [g for c in chunk_grads for g in c]
            problems = []
            if topo.pp.rank == topo.pp.size - 1 and not np.allclose(losses, ref_losses, rtol=1e-5):
                problems.append(f"losses {losses} != {ref_losses}")
            got = full_arrays(stack, topo, params, grads)
            for key, g in got.items():
                if not np.allclose(g, ref_full[key], rtol=1e-4, atol=1e-5):
                    problems.append(f"grad {key} max err {np.abs(g - ref_full[key]).max()}")
            if len(got) != len(params) or not got:
                problems.append("no gradients compared")
            # the optimizer's global norm spans the stages (and counts tp-replicated values once)
            from mindspore import nn

            from mm_parallel.optimizer import DistributedOptimizer, OptimizerConfig

            norm = DistributedOptimizer(nn.CellList(blocks), OptimizerConfig(clip_grad=0), topo).step(grads)["grad_norm"]
            ref_norm = float(np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in ref_full.values())))
            if not np.isclose(norm, ref_norm, rtol=1e-5):
                problems.append(f"grad norm {norm} != {ref_norm}")
            results[name] = problems
        except Exception:
            results[name] = [traceback.format_exc()]
    return results
