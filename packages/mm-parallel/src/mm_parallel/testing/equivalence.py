"""Layout equivalence: a model trained under a parallel layout equals the same model on one process.

This is the done-criterion of every parallel feature: load the same checkpoint under the layout
(each rank reading its shard), take optimizer steps on the same global batch, and compare with
one process: the loss of every step, the first step's gradients as the optimizer sees them
(summed over cp, sequence-parallel ones over tp, averaged over dp; tp shards gathered) and the
final parameters. Pipeline stages compare the parameters they hold (and the loss if last); the
caller checks that the stages together covered every parameter (the ``:names`` entries).

A model plugs in through a `ModelSpec`; run `run_cases` inside an msrun launch
(`mm_parallel.launch.run_distributed`), many layouts per launch.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np

# eps well above the gradients' rounding noise: AdamW divides by sqrt(v) + eps, and for a parameter
# whose gradient is ~0 a smaller eps would turn rounding differences into lr-sized steps
OPTIM = {"lr": 1e-3, "weight_decay": 0.0, "clip_grad": 0.0, "eps": 1e-5}

# bf16 layouts against the bf16 single process: each layout rounds at other points (a tp rank's
# partial sums, a dp rank's own gradients), so they agree to bf16's precision, not fp32's. Measured
# on the tiny Qwen2.5-VL over tp2+sp, pp2, cp2 (Ulysses, ring), dp2 ZeRO-1: losses within 2e-4,
# first-step gradients 1.9e-2 and parameters after two AdamW steps 1.7e-2 (max |diff| / max |ref|);
# a broken layout is off by O(1).
BF16_TOLERANCE = {"loss_rtol": 1e-3, "rel": 5e-2}


@dataclass
class ModelSpec:
    """How the harness drives one model family.

    build(path, topology, case) -> the chunks (virtual pipeline stages) this rank holds, loaded
        from ``path`` and planned as ``case`` says (recompute, LoRA, freezing ...)
    split(batch, index, parts) -> part ``index`` of ``parts`` equal slices of the batch's samples
    samples(batch) -> the number of samples in a batch
    global_name(model, name) -> a parameter's name in the whole model (pipeline numbering; default
        ParallelModel.global_name)
    loss(model, batch) -> the loss of a whole-model forward
    save(chunks, folder) -> write the chunks' model (save_pretrained) and LoRA adapters (to
        folder/adapters); every rank calls it (for `save_under_layouts`)
    after_step(chunks) -> what the trainer does after each optimizer step (default: MoE expert-bias
        updates, mm_parallel.moe.update_expert_biases)
    """
    build: Callable
    split: Callable[[dict, int, int], dict]
    samples: Callable[[dict], int]
    global_name: Callable = field(default=lambda model, name: model.global_name(name))
    loss: Callable = field(default=lambda model, batch: model(**batch).loss)
    save: Optional[Callable] = None
    after_step: Optional[Callable] = None


def _after_step(spec: ModelSpec, chunks) -> None:
    if spec.after_step is not None:
        spec.after_step(chunks)
        return
    from mm_parallel.moe import update_expert_biases

    for model in chunks:
        update_expert_biases(model)


def full_arrays(spec: ModelSpec, chunks, topo, tensors) -> Dict[str, np.ndarray]:
    """{global parameter name: full numpy array} of one tensor per trainable parameter of the
    chunks (in order), shards gathered."""
    from mm_parallel.census import owned_parameters
    from mm_parallel.sharding import sharding_of

    out, tensors = {}, iter(tensors)
    for model in chunks:
        owners = {id(p): (name, cell, attr) for name, p, cell, attr in owned_parameters(model)}
        for param in model.trainable_params():
            tensor = next(tensors)
            name, _, _ = owners[id(param)]
            sharding = sharding_of(param)
            full = sharding.gather(tensor, topo) if sharding.sharded else tensor
            out[spec.global_name(model, name)] = np.asarray(full.asnumpy(), np.float32)
    return out


def finalised(params, topo, grads) -> List:
    """Gradients as the optimizer reduces them (sequence-parallel ones over tp; summed over each
    parameter's replicas, dp_cp or expert-dp; divided by dp)."""
    import mindspore as ms

    from mm_parallel import comm
    from mm_parallel.ops.device import as_type
    from mm_parallel.sequence_parallel import sync_sequence_parallel_grads
    from mm_parallel.sharding import sharding_of

    grads = [as_type(g, ms.float32) for g in grads]  # as the optimizer: low-precision gradients reduced in fp32
    if topo.tp.size > 1:
        grads = sync_sequence_parallel_grads(params, grads, topo.tp)
    grads = [comm.all_reduce(g, topo.groups[sharding_of(p).grad_sync]) for p, g in zip(params, grads)]
    return [g / topo.dp.size for g in grads] if topo.dp.size > 1 else list(grads)


def dp_part(spec: ModelSpec, batch: dict, topo) -> dict:
    """This data-parallel rank's samples."""
    return batch if topo.dp.size == 1 else spec.split(batch, topo.dp.rank, topo.dp.size)


def loss_and_grads(spec: ModelSpec, chunks, topo, local: dict):
    """(loss or None where this rank does not see it, gradients in the chunks' parameter order).
    Under pipeline parallelism every sample is its own micro-batch."""
    import mindspore as ms

    from mm_parallel import comm, pipeline

    params = [p for model in chunks for p in model.trainable_params()]
    if topo.pp.size == 1:
        model = chunks[0]
        loss, grads = ms.value_and_grad(lambda: spec.loss(model, local), None, params)()
        if topo.dp.size > 1:
            loss = comm.all_reduce(loss, topo.dp) / topo.dp.size
        return float(loss.asnumpy()), list(grads)
    samples = spec.samples(local)
    micro = [(part, part) for part in (spec.split(local, i, samples) for i in range(samples))]
    last = chunks[-1]
    if len(chunks) == 1:
        losses, grads = pipeline.train_step_1f1b(last.pipeline_stage, params, micro, last.pipeline_loss, topo,
                                                 with_batch=True, grad_dtype=ms.float32)
    else:
        losses, per_chunk = pipeline.train_step_interleaved(
            [m.pipeline_stage for m in chunks], [m.trainable_params() for m in chunks], micro, last.pipeline_loss,
            topo, with_batch=True, grad_dtype=ms.float32)
        grads = [g for chunk in per_chunk for g in chunk]
    if not losses:  # not the last stage
        return None, grads
    loss = pipeline.mean_loss(losses)
    if topo.dp.size > 1:  # a dp group shares its pipeline stage
        loss = comm.all_reduce(loss, topo.dp) / topo.dp.size
    return float(loss.asnumpy()), grads


def train(spec: ModelSpec, path: str, topo, case: dict, batch: dict, steps: int = 2, optim: Optional[dict] = None):
    """(losses, first-step finalised gradients, final parameters) of ``steps`` optimizer steps."""
    from mm_parallel import precision

    chunks = spec.build(path, topo, case)
    policy = precision.Precision(case.get("precision", "fp32"))
    for model in chunks:  # as the trainer does (mm_train.loop), after the spec's plan
        precision.apply(model, policy)
    try:
        return _steps(spec, chunks, topo, batch, steps, optim)
    finally:
        precision.activate(precision.Precision())


def _steps(spec: ModelSpec, chunks, topo, batch: dict, steps: int, optim: Optional[dict]):
    from mm_parallel.optimizer import DistributedOptimizer, OptimizerConfig

    opt = DistributedOptimizer(chunks[0] if len(chunks) == 1 else chunks, OptimizerConfig(**(optim or OPTIM)), topo)
    params = [p for model in chunks for p in model.trainable_params()]
    local = dp_part(spec, batch, topo)
    losses, first = [], None
    for _ in range(steps):
        loss, grads = loss_and_grads(spec, chunks, topo, local)
        losses.append(loss)
        if first is None:
            first = full_arrays(spec, chunks, topo, finalised(params, topo, grads))
        opt.step(grads)
        _after_step(spec, chunks)
    return losses, first, full_arrays(spec, chunks, topo, [p for model in chunks for p in model.trainable_params()])


def compare(got, want, loss_rtol: float = 1e-5, rel: float = 1e-4, param_rel: Optional[float] = None) -> List[str]:
    """Problems found; a pipeline stage compares the parameters it holds (and the loss if last).
    ``rel`` bounds the gradients and, unless ``param_rel`` is given, the parameters after the steps."""
    (losses, grads, params), (ref_losses, ref_grads, ref_params) = got, want
    problems = []
    if None not in losses and not np.allclose(losses, ref_losses, rtol=loss_rtol, atol=0):
        problems.append(f"losses {losses} != {ref_losses}")
    bounds = {"grad": rel, "param": rel if param_rel is None else param_rel}
    for label, arrays, refs in (("grad", grads, ref_grads), ("param", params, ref_params)):
        if not arrays or not set(arrays) <= set(refs):
            problems.append(f"{label} names not in the single-process model: {sorted(set(arrays) - set(refs))[:5]}")
            continue
        for key, array in arrays.items():
            ref = refs[key]
            scale = max(np.abs(ref).max(), 1e-30)
            if np.abs(array - ref).max() / scale > bounds[label]:
                problems.append(f"{label} {key} rel err {np.abs(array - ref).max() / scale:.2e}")
    return problems


def run_cases(spec: ModelSpec, path: str, cases: Dict[str, dict], batch: dict, reference_key=lambda case: (),
              steps: int = 2):
    """cases: {name: {"layout": ParallelConfig kwargs, "checkpoint": sub-folder of path,
    "precision": fp32 | bf16 | fp16 (applied as the trainer applies it), "tolerance": compare's
    loss_rtol / rel, "device": "ascend_stand_ins" (the layout runs the Ascend path on its
    stand-ins, mm_parallel.testing.device_path; the Ascend calls made land in
    ``name + ":stand_ins"``), "stand_ins_float32": False (no float32 widening: a bf16 case's
    kernels take bf16 operands, as on Ascend), ... what spec.build reads}} -> {name: [problems],
    name + ":names": [parameter names this rank checked], name + ":reference_names": [...]}. One
    single-process reference per (checkpoint, precision, reference_key(case)) — reference_key: the
    plan choices that change which parameters train."""
    import mm_parallel
    from mm_parallel import ParallelConfig
    from mm_parallel.topology import Topology

    solo = Topology.build(ParallelConfig(), 1, 0)
    references, results = {}, {}
    for name, case in cases.items():
        folder = os.path.join(path, case.get("checkpoint", ""))
        key = (folder, case.get("precision", "fp32")) + tuple(reference_key(case))
        try:
            if key not in references:
                plain = {k: v for k, v in case.items() if k not in ("layout", "recompute")}
                references[key] = train(spec, folder, solo, plain, batch, steps)
            topo = mm_parallel.initialize(ParallelConfig(**case["layout"]))
            if case.get("device") == "ascend_stand_ins":  # the fused kernels and HCCL calls, on CPU
                from mm_parallel.testing.device_path import ascend_stand_ins

                with ascend_stand_ins(float32=case.get("stand_ins_float32", True)) as calls:
                    got = train(spec, folder, topo, case, batch, steps)
                    results[f"{name}:stand_ins"] = sorted(set(calls))
            else:
                got = train(spec, folder, topo, case, batch, steps)
            results[name] = compare(got, references[key], **case.get("tolerance", {}))
            results[f"{name}:names"] = sorted(got[1])
            results[f"{name}:reference_names"] = sorted(references[key][1])
        except Exception:
            results[name] = [traceback.format_exc()]
    return results


def check_results(results: List[dict], cases: Dict[str, dict]) -> None:
    """Assert every rank found no problem in any case and that the ranks together checked every
    trainable parameter of the single-process model (pipeline stages each hold a part)."""
    names: Dict[str, set] = {}
    for rank, result in enumerate(results):
        failed = {case: result.get(case, ["missing"]) for case in cases if result.get(case, ["missing"])}
        assert not failed, (rank, failed)
        for key, value in result.items():
            if key.endswith("names"):
                names.setdefault(key, set()).update(value)
    for case in cases:
        assert names[f"{case}:names"] == names[f"{case}:reference_names"], case


def save_under_layouts(spec: ModelSpec, path: str, out: str, layouts: Dict[str, tuple]) -> Dict[str, List[str]]:
    """layouts: {name: (ParallelConfig kwargs, checkpoint sub-folder of path)}. For each: build
    the model with LoRA adapters (read from the checkpoint's ``adapters``) under the layout and
    save model and adapters to ``out/<name>`` with spec.save. Returns {name: [problems]}."""
    import mm_parallel
    from mm_parallel import ParallelConfig

    results = {}
    for name, (layout, folder) in layouts.items():
        try:
            topo = mm_parallel.initialize(ParallelConfig(**layout))
            chunks = spec.build(os.path.join(path, folder), topo, {"lora": True})
            spec.save(chunks, os.path.join(out, name))
            results[name] = []
        except Exception:
            results[name] = [traceback.format_exc()]
    return results


def saved_folder_problems(original: str, saved: str, stages: int, base: str) -> List[str]:
    """What differs between a checkpoint folder and the one saved from it under a layout with
    ``stages`` virtual pipeline stages: tensor names and values (bit-exact), the shard files the
    index names (one per stage), and the PEFT adapters in ``adapters/``."""
    from safetensors.numpy import load_file

    from mm_parallel.hf_checkpoint import SafetensorsFolder

    problems = []
    want, got = SafetensorsFolder(original), SafetensorsFolder(saved)
    if sorted(got.names()) != sorted(want.names()):
        problems.append(f"tensor names differ: {sorted(set(got.names()) ^ set(want.names()))[:5]}")
    problems += [f"{k} differs" for k in want.names() if k in got and not np.array_equal(got.read(k), want.read(k))]
    if stages > 1:
        import json

        with open(os.path.join(saved, base + ".index.json")) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        stem = base[: -len(".safetensors")]
        if files != [f"{stem}-{k:05d}-of-{stages:05d}.safetensors" for k in range(1, stages + 1)]:
            problems.append(f"index names {files}, expected one file per virtual stage")
    adapters = load_file(os.path.join(original, "adapters", "adapter_model.safetensors"))
    written = load_file(os.path.join(saved, "adapters", "adapter_model.safetensors"))
    if sorted(written) != sorted(adapters) or not all(np.array_equal(written[k], adapters[k]) for k in adapters):
        problems.append("adapters differ")
    return problems
