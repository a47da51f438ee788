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


def sample_part(inputs, index: int, parts: int):
    """Part ``index`` of ``parts`` equal slices of the samples (and their images)."""
    per = inputs["input_ids"].shape[0] // parts
    lo, hi = index * per, (index + 1) * per
    patches = int(np.prod(inputs["image_grid_thw"][0]))  # one image per sample, all the same grid
    out = {k: v[lo:hi] for k, v in inputs.items() if k not in ("pixel_values", "image_grid_thw")}
    out["pixel_values"] = inputs["pixel_values"][lo * patches:hi * patches]
    out["image_grid_thw"] = inputs["image_grid_thw"][lo:hi]
    return out


def dp_part(inputs, topo):
    """This data-parallel rank's samples."""
    return inputs if topo.dp.size == 1 else sample_part(inputs, topo.dp.rank, topo.dp.size)


def full_arrays(chunks, topo, tensors):
    """{global parameter path: full numpy array} of one tensor per trainable parameter of the
    chunks (in order), tp shards gathered."""
    from mm_models_vl.qwen2_5_vl.checkpoint import global_name
    from mm_parallel.hf_checkpoint import owned_parameters
    from mm_parallel.tensor_parallel import unshard

    out, tensors = {}, iter(tensors)
    for model in chunks:
        owners = {id(p): (name, cell, attr) for name, p, cell, attr in owned_parameters(model)}
        for param in model.trainable_params():
            tensor = next(tensors)
            name, cell, attr = owners[id(param)]
            dim = getattr(cell, "tp_split_dims", {}).get(attr)
            full = tensor if dim is None or topo.tp.size == 1 else unshard(tensor, topo.tp, dim)
            out[global_name(model, name)] = full.asnumpy()
    return out


def finalised(params, topo, grads):
    """Gradients as the optimizer reduces them (cp sum, sequence-parallel over tp, dp mean)."""
    from mm_parallel import comm
    from mm_parallel.sequence_parallel import sync_sequence_parallel_grads

    if topo.tp.size > 1:
        grads = sync_sequence_parallel_grads(params, grads, topo.tp)
    if topo.dp_cp.size > 1:
        grads = [comm.all_reduce(g, topo.dp_cp) for g in grads]
    return [g / topo.dp.size for g in grads] if topo.dp.size > 1 else list(grads)


def build(path, topo, case):
    """This rank's model chunks (one without virtual pipeline stages), loaded and planned."""
    from mm_models_vl import Qwen2_5_VLForConditionalGeneration
    from mm_models_vl.qwen2_5_vl.parallel_plan import LoraConfig, parallelize
    chunks = []
    for chunk in range(topo.config.vpp):
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, topology=topo, chunk=chunk)
        parallelize(model, recompute=case.get("recompute", "none"), recompute_num_layers=1,
                    lora=LoraConfig(r=4, alpha=8.0) if case.get("lora") else None, freeze=case.get("freeze", ()))
        if case.get("lora"):
            model.load_adapter(os.path.join(path, "adapters"))
        chunks.append(model)
    return chunks


def loss_and_grads(chunks, topo, local):
    """(loss or None where this rank does not see it, gradients in the chunks' parameter order)."""
    import mindspore as ms

    from mm_parallel import comm, pipeline

    params = [p for model in chunks for p in model.trainable_params()]
    if topo.pp.size == 1:
        model = chunks[0]
        loss, grads = ms.value_and_grad(lambda: model(**local).loss, None, params)()
        if topo.dp.size > 1:
            loss = comm.all_reduce(loss, topo.dp) / topo.dp.size
        return float(loss.asnumpy()), list(grads)
    samples = local["input_ids"].shape[0]
    micro = [(part, part) for part in (sample_part(local, i, samples) for i in range(samples))]
    last = chunks[-1]
    if len(chunks) == 1:
        losses, grads = pipeline.train_step_1f1b(last.pipeline_stage, params, micro, last.pipeline_loss, topo,
                                                 with_batch=True)
    else:
        losses, per_chunk = pipeline.train_step_interleaved(
            [m.pipeline_stage for m in chunks], [m.trainable_params() for m in chunks], micro, last.pipeline_loss,
            topo, with_batch=True)
        grads = [g for chunk in per_chunk for g in chunk]
    if not losses:  # not the last stage
        return None, grads
    loss = ms.Tensor(np.float32(np.mean(losses)))
    if topo.dp.size > 1:  # a dp group shares its pipeline stage
        loss = comm.all_reduce(loss, topo.dp) / topo.dp.size
    return float(loss.asnumpy()), grads


def train(path, topo, case, inputs):
    from mm_parallel.optimizer import DistributedOptimizer, OptimizerConfig

    chunks = build(path, topo, case)
    opt = DistributedOptimizer(chunks[0] if len(chunks) == 1 else chunks, OptimizerConfig(**OPTIM), topo)
    params = [p for model in chunks for p in model.trainable_params()]
    local = dp_part(inputs, topo)
    losses, first = [], None
    for _ in range(STEPS):
        loss, grads = loss_and_grads(chunks, topo, local)
        losses.append(loss)
        if first is None:
            first = full_arrays(chunks, topo, finalised(params, topo, grads))
        opt.step(grads)
    return losses, first, full_arrays(chunks, topo, [p for model in chunks for p in model.trainable_params()])


def compare(got, want):
    """Problems found; a pipeline stage compares the parameters it holds (and the loss if last)."""
    (losses, grads, params), (ref_losses, ref_grads, ref_params) = got, want
    problems = []
    if None not in losses and not np.allclose(losses, ref_losses, rtol=1e-5, atol=0):
        problems.append(f"losses {losses} != {ref_losses}")
    for label, arrays, refs in (("grad", grads, ref_grads), ("param", params, ref_params)):
        if not arrays or not set(arrays) <= set(refs):
            problems.append(f"{label} names not in the single-process model: {sorted(set(arrays) - set(refs))[:5]}")
            continue
        for key, array in arrays.items():
            ref = refs[key]
            scale = max(np.abs(ref).max(), 1e-30)
            if np.abs(array - ref).max() / scale > 1e-4:
                problems.append(f"{label} {key} rel err {np.abs(array - ref).max() / scale:.2e}")
    return problems


def run_parallel_cases(path, cases):
    """cases: {name: {"layout": ParallelConfig kwargs, "recompute", "lora", "freeze", "checkpoint":
    sub-folder of path}} -> {name: [problems], name + ":names": [parameter names this rank checked], name + ":reference_names"}."""
    import mm_parallel
    from mm_parallel import ParallelConfig
    from mm_parallel.topology import Topology

    solo = Topology.build(ParallelConfig(), 1, 0)
    inputs = batch()
    references, results = {}, {}
    for name, case in cases.items():
        folder = os.path.join(path, case.get("checkpoint", ""))
        key = (folder, bool(case.get("lora")), tuple(case.get("freeze", ())))
        try:
            if key not in references:
                plan = {"lora": case.get("lora"), "freeze": case.get("freeze", ())}
                references[key] = train(folder, solo, plan, inputs)
            topo = mm_parallel.initialize(ParallelConfig(**case["layout"]))
            got = train(folder, topo, case, inputs)
            results[name] = compare(got, references[key])
            results[f"{name}:names"] = sorted(got[1])
            results[f"{name}:reference_names"] = sorted(references[key][1])
        except Exception:
            results[name] = [traceback.format_exc()]
    return results


def save_under_layouts(path, out, layouts):
    """layouts: {name: (ParallelConfig kwargs, checkpoint sub-folder)}. For each: load the
    checkpoint (and its adapters) under the layout, save model and adapters to ``out/<name>`` with
    save_pretrained / save_adapter. Returns {name: [problems]}."""
    import mm_parallel
    from mm_models_vl import Qwen2_5_VLForConditionalGeneration
    from mm_models_vl.qwen2_5_vl.checkpoint import save_pretrained
    from mm_models_vl.qwen2_5_vl.parallel_plan import LoraConfig, parallelize
    from mm_parallel import ParallelConfig

    results = {}
    for name, (layout, folder) in layouts.items():
        try:
            folder = os.path.join(path, folder)
            topo = mm_parallel.initialize(ParallelConfig(**layout))
            lora = LoraConfig(r=4, alpha=8.0)
            chunks = []
            for chunk in range(topo.config.vpp):
                model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, topology=topo, chunk=chunk)
                chunks.append(parallelize(model, lora=lora))
                model.load_adapter(os.path.join(folder, "adapters"))
            save_pretrained(chunks, os.path.join(out, name))
            chunks[0].save_adapter(os.path.join(out, name, "adapters"), lora, chunks)
            results[name] = []
        except Exception:
            results[name] = [traceback.format_exc()]
    return results
