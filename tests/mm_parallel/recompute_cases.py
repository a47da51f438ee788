"""Recompute modes on the reference stack: loss and gathered gradients against the single-process
stack without recompute. Written for any layout (tp, sp, cp: shards gathered, cp grads summed);
multi-process use waits on the MindSpore recompute fault described in mm_parallel.recompute."""

from __future__ import annotations

import traceback

import numpy as np

B, S = 2, 8


def loss_and_grads(stack, topo, x, c):
    import mindspore as ms

    from mm_parallel import comm
    from mm_parallel.sequence_parallel import sync_sequence_parallel_grads
    from mm_parallel.tensor_parallel import unshard
    from reference_model import run_stack

    params = stack.trainable_params()
    loss, grads = ms.value_and_grad(lambda t: (run_stack(stack, t) * c).sum(), None, params)(x)
    if topo.cp.size > 1:  # every cp rank saw a slice of the sequence: sum like data parallel
        loss, grads = comm.all_reduce(loss, topo.cp), [comm.all_reduce(g, topo.cp) for g in grads]
    if topo.config.sequence_parallel:
        loss = comm.all_reduce(loss, topo.tp)
    if topo.tp.size > 1:  # parameters whose gradient is partial over tp (SP norms, LoRA A of column layers)
        grads = sync_sequence_parallel_grads(params, grads, topo.tp)
    full = {}
    cells = dict(stack.cells_and_names())
    for p, g in zip(params, grads):
        owner, _, attr = p.name.rpartition(".")
        dim = getattr(cells.get(owner), "tp_split_dims", {}).get(attr)
        full[p.name] = (g if dim is None else unshard(g, topo.tp, dim)).asnumpy()
    return float(loss.asnumpy()), full


def local_slice(t, topo):
    from mm_parallel import context_parallel
    from mm_parallel.comm.base import chunk

    t = context_parallel.split_sequence(t, 1, topo)
    if topo.config.sequence_parallel:
        t = chunk(t, topo.tp.size, topo.tp.rank, 1)
    return t


def run_recompute_cases(layouts, modes):
    from mindspore import Tensor

    import mm_parallel
    from mm_parallel import ParallelConfig
    from mm_parallel.recompute import apply_recompute
    from mm_parallel.topology import Topology
    from reference_model import H, build_stack

    rng = np.random.default_rng(1)
    solo = Topology.build(ParallelConfig(), 1, 0)
    results = {}
    for causal in (True, False):
        x = Tensor(rng.standard_normal((B, S, H)).astype(np.float32))
        c = Tensor(rng.standard_normal((B, S, H)).astype(np.float32))
        ref_loss, ref_grads = loss_and_grads(build_stack(solo, causal=causal), solo, x, c)
        for name, layout in layouts.items():
            for mode in modes:
                case = f"{name}/{mode}/{'causal' if causal else 'full'}"
                try:
                    topo = mm_parallel.initialize(ParallelConfig(**layout))
                    stack = build_stack(topo, causal=causal)
                    marked = apply_recompute(stack, mode.rstrip("1"), num_layers=1 if mode == "block1" else None,
                                             topology=topo)
                    loss, grads = loss_and_grads(stack, topo, local_slice(x, topo), local_slice(c, topo))
                    problems = [] if np.isclose(loss, ref_loss, rtol=1e-5) else [f"loss {loss} != {ref_loss}"]
                    for key, want in ref_grads.items():
                        if not np.allclose(grads[key], want, rtol=1e-4, atol=1e-5):
                            problems.append(f"grad {key} max err {np.abs(grads[key] - want).max()}")
                    if mode != "none" and not marked:
                        problems.append("nothing was marked for recompute")
                    results[case] = problems
                except Exception:
                    results[case] = [traceback.format_exc()]
    return results
