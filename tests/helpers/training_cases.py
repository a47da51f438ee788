"""Three AdamW steps of the reference stack under a layout (tp, tp+sp, cp Ulysses / Ring /
hybrid, tp x cp; each with recompute none / full / block / selective; LoRA) against the same three
steps on one process: loss of every step, first-step gradients and final parameters, gathered."""

from __future__ import annotations

import traceback

import numpy as np

STEPS, B, S = 3, 2, 8


def batches():
    from helpers.reference_model import H

    rng = np.random.default_rng(1)
    return [tuple(rng.standard_normal((B, S, H)).astype(np.float32) for _ in range(2)) for _ in range(STEPS)]


def build(topo, causal, recompute, adapter_dir):
    from helpers.lora_cases import ALPHA, TARGETS, R
    from helpers.reference_model import build_stack

    from mm_parallel.lora import apply_lora, load_lora
    from mm_parallel.recompute import apply_recompute

    stack = build_stack(topo, causal=causal)
    if adapter_dir:  # adapters with random A and B (PEFT's B starts at zero), cut to this layout
        apply_lora(stack, TARGETS, R, ALPHA)
        load_lora(stack, adapter_dir)
    apply_recompute(stack, recompute.rstrip("1"), num_layers=1 if recompute == "block1" else None)
    return stack


def train(stack, topo, data):
    """(losses, first-step full gradients, final full parameters) after len(data) AdamW steps."""
    from helpers.reference_model import AdamW, full_arrays, local_slice, stack_loss_and_grads
    from mindspore import Tensor

    opt = AdamW(stack.trainable_params())
    losses, first = [], None
    for x, c in data:
        x_local, c_local = local_slice(Tensor(x), topo), local_slice(Tensor(c), topo)
        loss, params, grads = stack_loss_and_grads(stack, topo, x_local, c_local)
        first = first or full_arrays(stack, topo, params, grads)
        opt.step(grads)
        losses.append(float(loss.asnumpy()))
    params = stack.trainable_params()
    return losses, first, full_arrays(stack, topo, params, params)


def compare(got, want):
    (losses, grads, params), (ref_losses, ref_grads, ref_params) = got, want
    problems = []
    if not np.allclose(losses, ref_losses, rtol=1e-5):
        problems.append(f"losses {losses} != {ref_losses}")
    for label, arrays, refs, atol in (("grad", grads, ref_grads, 5e-5), ("param", params, ref_params, 1e-5)):
        if sorted(arrays) != sorted(refs):
            problems.append(f"{label} names {sorted(arrays)} != {sorted(refs)}")
            continue
        for key, ref in refs.items():
            if not np.allclose(arrays[key], ref, rtol=1e-4, atol=atol):
                problems.append(f"{label} {key} max err {np.abs(arrays[key] - ref).max()}")
    return problems


def run_training_cases(cases):
    """cases: {name: {"layout": ParallelConfig kwargs, "recompute": [modes], "causal": [bools],
    "adapter_dir": PEFT folder or absent}}; returns {name/mode/causal|full: [problems]}."""
    import mm_parallel
    from mm_parallel import ParallelConfig
    from mm_parallel.topology import Topology

    solo = Topology.build(ParallelConfig(), 1, 0)
    data = batches()
    references, results = {}, {}
    for name, case in cases.items():
        for causal in case.get("causal", [True]):
            lora = case.get("adapter_dir")
            if (causal, lora) not in references:
                references[causal, lora] = train(build(solo, causal, "none", lora), solo, data)
            for mode in case.get("recompute", ["none"]):
                key = f"{name}/{mode}/{'causal' if causal else 'full'}"
                try:
                    topo = mm_parallel.initialize(ParallelConfig(**case["layout"]))
                    results[key] = compare(train(build(topo, causal, mode, lora), topo, data), references[causal, lora])
                except Exception:
                    results[key] = [traceback.format_exc()]
    return results
