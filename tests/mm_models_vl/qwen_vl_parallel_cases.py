"""Qwen2.5-VL under a layout vs one process, inside one msrun launch.

Every case loads the same transformers checkpoint with from_pretrained under its topology (each
rank reading its shard), applies the plan (recompute, LoRA with PEFT adapters read from
``path/adapters``, freezing), then runs two DistributedOptimizer
steps on a batch of two image+text samples. Compared with the same on one process: the loss of
each step, the first step's gradients (finalised as the optimizer sees them: summed over cp,
sequence-parallel ones over tp, averaged over dp; tp shards gathered) and the final parameters.
"""

from __future__ import annotations

import os
import traceback

import numpy as np

from qwen_vl_reference import IMAGE, PATCH_DIM, merged, placeholder, with_types_and_labels

STEPS = 2
# eps well above the gradients' rounding noise: AdamW divides by sqrt(v) + eps, and for a parameter
# whose gradient is ~0 a smaller eps would turn rounding differences into lr-sized steps
OPTIM = {"lr": 1e-3, "weight_decay": 0.0, "clip_grad": 0.0, "eps": 1e-5}


def batch(seed: int = 0):
    """Two samples of one structure (same image grid, same length 32: divisible by 2 x cp x tp),
    so every data-parallel rank averages over as many tokens as the other."""
    rng = np.random.default_rng(seed)
    grid = (1, 4, 8)
    rows = [rng.integers(3, 240, 5).tolist() + placeholder(IMAGE, merged(grid)) + rng.integers(3, 240, 17).tolist()
            for _ in range(2)]
    inputs = {"input_ids": np.array(rows, np.int64),
              "pixel_values": rng.standard_normal((2 * int(np.prod(grid)), PATCH_DIM)).astype(np.float32),
              "image_grid_thw": np.array([grid, grid], np.int64)}
    assert inputs["input_ids"].shape[1] == 32
    return with_types_and_labels(inputs)


def dp_part(inputs, topo):
    """This data-parallel rank's samples (and their images)."""
    if topo.dp.size == 1:
        return inputs
    per = inputs["input_ids"].shape[0] // topo.dp.size
    lo, hi = topo.dp.rank * per, (topo.dp.rank + 1) * per
    patches = int(np.prod(inputs["image_grid_thw"][0]))  # one image per sample, all the same grid
    out = {k: v[lo:hi] for k, v in inputs.items() if k not in ("pixel_values", "image_grid_thw")}
    out["pixel_values"] = inputs["pixel_values"][lo * patches:hi * patches]
    out["image_grid_thw"] = inputs["image_grid_thw"][lo:hi]
    return out


def full_arrays(model, topo, tensors):
    """{parameter path: full numpy array} of one tensor per trainable parameter, tp shards gathered."""
    from mm_parallel.hf_checkpoint import owned_parameters
    from mm_parallel.tensor_parallel import unshard

    owners = {id(p): (name, cell, attr) for name, p, cell, attr in owned_parameters(model)}
    out = {}
    for param, tensor in zip(model.trainable_params(), tensors):
        name, cell, attr = owners[id(param)]
        dim = getattr(cell, "tp_split_dims", {}).get(attr)
        out[name] = (tensor if dim is None or topo.tp.size == 1 else unshard(tensor, topo.tp, dim)).asnumpy()
    return out


def finalised(model, topo, grads):
    """Gradients as the optimizer reduces them (cp sum, sequence-parallel over tp, dp mean)."""
    from mm_parallel import comm
    from mm_parallel.sequence_parallel import sync_sequence_parallel_grads

    params = model.trainable_params()
    if topo.tp.size > 1:
        grads = sync_sequence_parallel_grads(params, grads, topo.tp)
    if topo.dp_cp.size > 1:
        grads = [comm.all_reduce(g, topo.dp_cp) for g in grads]
    return [g / topo.dp.size for g in grads] if topo.dp.size > 1 else list(grads)


def train(path, topo, case, inputs):
    import mindspore as ms

    from mm_models_vl import Qwen2_5_VLForConditionalGeneration
    from mm_models_vl.qwen2_5_vl.parallel_plan import LoraConfig, parallelize
    from mm_parallel import comm
    from mm_parallel.lora import load_lora
    from mm_parallel.optimizer import DistributedOptimizer, OptimizerConfig

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, topology=topo)
    parallelize(model, recompute=case.get("recompute", "none"), recompute_num_layers=1,
                lora=LoraConfig(r=4, alpha=8.0) if case.get("lora") else None, freeze=case.get("freeze", ()))
    if case.get("lora"):
        load_lora(model, os.path.join(path, "adapters"))
    opt = DistributedOptimizer(model, OptimizerConfig(**OPTIM), topo)
    local = dp_part(inputs, topo)
    params = model.trainable_params()
    losses, first = [], None
    for _ in range(STEPS):
        loss, grads = ms.value_and_grad(lambda: model(**local).loss, None, params)()
        if topo.dp.size > 1:
            loss = comm.all_reduce(loss, topo.dp) / topo.dp.size
        losses.append(float(loss.asnumpy()))
        if first is None:
            first = full_arrays(model, topo, finalised(model, topo, grads))
        opt.step(grads)
    return losses, first, full_arrays(model, topo, model.trainable_params())


def compare(got, want):
    (losses, grads, params), (ref_losses, ref_grads, ref_params) = got, want
    problems = []
    if not np.allclose(losses, ref_losses, rtol=1e-5, atol=0):
        problems.append(f"losses {losses} != {ref_losses}")
    for label, arrays, refs in (("grad", grads, ref_grads), ("param", params, ref_params)):
        if sorted(arrays) != sorted(refs):
            problems.append(f"{label} names differ: {sorted(set(arrays) ^ set(refs))[:5]}")
            continue
        for key, ref in refs.items():
            scale = max(np.abs(ref).max(), 1e-30)
            if np.abs(arrays[key] - ref).max() / scale > 1e-4:
                problems.append(f"{label} {key} rel err {np.abs(arrays[key] - ref).max() / scale:.2e}")
    return problems


def run_parallel_cases(path, cases):
    """cases: {name: {"layout": ParallelConfig kwargs, "recompute", "lora", "freeze"}} -> {name: [problems]}."""
    import mm_parallel
    from mm_parallel import ParallelConfig
    from mm_parallel.topology import Topology

    solo = Topology.build(ParallelConfig(), 1, 0)
    inputs = batch()
    references, results = {}, {}
    for name, case in cases.items():
        key = (bool(case.get("lora")), tuple(case.get("freeze", ())))
        try:
            if key not in references:
                references[key] = train(path, solo, {"lora": case.get("lora"), "freeze": case.get("freeze", ())},
                                        inputs)
            topo = mm_parallel.initialize(ParallelConfig(**case["layout"]))
            results[name] = compare(train(path, topo, case, inputs), references[key])
        except Exception:
            results[name] = [traceback.format_exc()]
    return results
