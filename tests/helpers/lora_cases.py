"""LoRA on the reference stack inside msrun workers: adapters read from a PEFT folder, loss and
gathered adapter gradients under tp equal one process, merge / unmerge, save round trip."""

from __future__ import annotations

import os
import traceback

import numpy as np

TARGETS = ["q", "v", "o", "up", "down"]
R, ALPHA = 4, 8.0


def write_adapters(path, layers=3):
    from helpers.reference_model import F, H
    from safetensors.numpy import save_file

    shapes = {"q": (H, H), "v": (H, H), "o": (H, H), "up": (F, H), "down": (H, F)}
    rng = np.random.default_rng(21)
    tensors = {}
    for i in range(layers):
        for t, (out_f, in_f) in shapes.items():
            tensors[f"base_model.model.{i}.{t}.lora_A.weight"] = rng.normal(0, 0.3, (R, in_f)).astype(np.float32)
            tensors[f"base_model.model.{i}.{t}.lora_B.weight"] = rng.normal(0, 0.3, (out_f, R)).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return tensors


def run_lora_cases(adapter_dir, out_dir, layouts):
    from helpers.reference_model import H, build_stack, local_slice, loss_and_grads, run_stack
    from mindspore import Tensor
    from safetensors.numpy import load_file

    import mm_parallel
    from mm_parallel import ParallelConfig
    from mm_parallel.lora import apply_lora, load_lora, merge_lora, save_lora, unmerge_lora
    from mm_parallel.topology import Topology

    rng = np.random.default_rng(2)
    x = Tensor(rng.standard_normal((2, 8, H)).astype(np.float32))
    c = Tensor(rng.standard_normal((2, 8, H)).astype(np.float32))
    solo = Topology.build(ParallelConfig(), 1, 0)
    ref = build_stack(solo)
    apply_lora(ref, TARGETS, R, ALPHA)
    load_lora(ref, adapter_dir)
    ref_loss, ref_grads = loss_and_grads(ref, solo, x, c)
    results = {"solo/trainable": [] if all("lora" in k for k in ref_grads) and len(ref_grads) == 30
               else [f"trainable params {sorted(ref_grads)}"]}
    for name, layout in layouts.items():
        try:
            topo = mm_parallel.initialize(ParallelConfig(**layout))
            stack = build_stack(topo)
            apply_lora(stack, TARGETS, R, ALPHA)
            load_lora(stack, adapter_dir)
            xl, cl = local_slice(x, topo), local_slice(c, topo)
            loss, grads = loss_and_grads(stack, topo, xl, cl)
            problems = [] if np.isclose(loss, ref_loss, rtol=1e-5) else [f"loss {loss} != {ref_loss}"]
            for key, want in ref_grads.items():
                # atol 5e-5: sums over the sequence shards in another order (SP) move single fp32 entries
                if not np.allclose(grads[key], want, rtol=1e-4, atol=5e-5):
                    problems.append(f"grad {key} max err {np.abs(grads[key] - want).max()}")
            before = run_stack(stack, xl).asnumpy()
            weights = {p.name: p.asnumpy().copy() for p in stack.get_parameters() if "base" in p.name}
            merge_lora(stack)
            if not np.allclose(run_stack(stack, xl).asnumpy(), before, rtol=1e-4, atol=1e-5):
                problems.append("merged output differs")
            unmerge_lora(stack)
            if any(not np.allclose(p.asnumpy(), weights[p.name],
                                   atol=1e-6) for p in stack.get_parameters() if p.name in weights):
                problems.append("unmerge did not restore the base weights")
            target = os.path.join(out_dir, name)
            save_lora(stack, target, TARGETS, R, ALPHA)
            saved, original = load_file(os.path.join(target, "adapter_model.safetensors")), load_file(
                os.path.join(adapter_dir, "adapter_model.safetensors"))
            if sorted(saved) != sorted(original) or any(not np.array_equal(saved[k], original[k]) for k in saved):
                problems.append("saved adapters differ from the loaded ones")
            results[name] = problems
        except Exception:
            results[name] = [traceback.format_exc()]
    return results
