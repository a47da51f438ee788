"""Memory per rank of a training run: parameters, gradients and optimizer state counted from the
model code itself, activations from the family's workload.

Parameters. Each distinct model-parallel position (tp rank x pp stage x ep rank; dp and cp ranks
hold copies) is built as the run builds it — its chunks under `Topology.build` of one of its
ranks, the family's plan (recompute, LoRA, freezing) applied — inside
`mm_parallel.census.shapes_only`, so no value exists. Then, as the run does:

    weights     every parameter held, in the dtype `mm_parallel.precision.dtype_under` gives it
    gradients   the trainable ones, summed over the step's micro-batches in train.grad_dtype
    optimizer   `mm_parallel.grad_buckets.state_bytes_of`: fp32 master + 2 moments of this rank's
                ZeRO slice of each bucket (optim.bucket_numel values at most); a ZeRO-3 slice is
                its own master (2 moments); with optim.offload: optimizer all of it in host
                memory instead (``optimizer_host_bytes``; a ZeRO-3 slice then gets a master copy
                there too: it is no longer its own)
    step        `mm_parallel.grad_buckets.step_buffer_values`: the step's reduced gradients and
                one bucket's transients, after the backward freed the activations: a rank's
                peak is the static bytes plus the larger of its activations and these
    ZeRO-3      the weights `mm_parallel.zero3.sharded_weights` picks held as float32 slices of
                ceil(n / D) values, their gradients too (whatever train.grad_dtype); the largest
                one gathered whole in its layer's dtype while its layer runs (all of them without
                parallel.reshard_after_forward: ``zero3_gather_bytes``, counted with the activations)

Activations of one micro-batch on a stage, with t = tp, s = the stack's tokens per sample / cp,
b = micro_batch_size and L the stage's layers of a stack, in the activation dtype (float32 where
the device emulates low precision); a stack that runs whole (the VL towers) has t = t_sp = cp = 1:

    per layer   fused kernels (Ascend): s b (outside / t_sp + inside / t)  (workload.LayerStack;
                the attention kernel keeps only its log-sum-exp); reference kernels (CPU): the
                same split of the stack's measured ``reference`` elements, plus
                NATIVE_SCORE_TENSORS float32 (heads x keys / t) score tensors per query (the
                fp32 core), REFERENCE_SCORE_TENSORS when emulating bf16 / fp16 (its attention
                runs step by step), which adds the stack's ``reference_emulated`` and one more
    recompute   full: L s b hidden / t_sp (each layer's input) + one layer's set while it is
                recomputed; block N: N layers like full, the rest whole; selective: no scores
    backward    the layer being back-propagated holds BACKWARD_WORKING of its set again
                (gradients, temporaries; the emulation's rounded copies have none), a recomputed
                one its whole set and RECOMPUTED_WORKING of it (the fp32 CPU core: its whole set
                and NATIVE_RECOMPUTED_SCORES score tensors): the peak is reached there
    pipeline    a stage's backward recomputes its forward (mm_parallel.pipeline), so micro-batches
                in flight keep only the stage's input, s b boundary_hidden / t_sp each: at most
                min(pp - stage, m) under 1F1B, the interleaved order's count under VPP
    logits      the last stage's fp32 logits and their gradient, 2 x 4 s b vocab / t

The reference terms are measured (benchmarks/plan_activation_memory.py prints prediction and
measurement side by side); the fused ones are Megatron's count (Korthikanti et al.), not yet
measured on Ascend.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Dict, List, Tuple

from mm_train.task import plan_options

# Deferred imports: MindSpore and mm-parallel (the CLI starts without loading MindSpore).

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Position:
    """One distinct model-parallel position: (tp rank, pp stage, ep rank), a rank holding it and
    how many ranks do."""

    tp: int
    pp: int
    ep: int
    rank: int
    count: int


def positions(parallel, world_size: int) -> List[Position]:
    """Every distinct (tp, pp, ep) position of a layout over ``world_size`` ranks."""
    from mm_parallel.topology import Topology

    found: Dict[Tuple[int, int, int], List[int]] = {}
    for rank in range(world_size):
        topo = Topology.build(parallel, world_size, rank)
        found.setdefault((topo.tp.rank, topo.pp.rank, topo.ep.rank), []).append(rank)
    return [Position(*key, ranks[0], len(ranks)) for key, ranks in sorted(found.items())]


def build_chunks(spec, recipe, raw_config: dict, model_config, topo, values: bool = False) -> list:
    """The model chunks ``topo``'s rank holds with the family's plan applied (``raw_config``: the
    config.json mapping that names the model class): by shape only, or with ``values`` as a run
    builds them from an inline config (random weights, cast by the precision policy first)."""
    import mm_parallel.precision
    from mm_parallel import census

    model_class = spec.recipe_model_class(recipe, raw_config)
    parallelize = spec.plan_function()
    lora = spec.lora_config_class()(**recipe.model.lora.options()) if recipe.model.lora else None
    options = plan_options(recipe, lora)
    config = model_class.load_config(model_config)
    with contextlib.nullcontext() if values else census.shapes_only():
        chunks = [model_class(config, topo, chunk=c) for c in range(topo.config.vpp)]
        for chunk in chunks:
            if values:
                mm_parallel.precision.apply(chunk, recipe.train.precision_policy())
            parallelize(chunk, **options)
    return chunks


def static_bytes(chunks, recipe, topo) -> Dict[str, int]:
    """{params, weights_bytes, grads_bytes, optimizer_bytes, optimizer_step_buffers_bytes} of a
    rank holding ``chunks``."""
    from mm_parallel.census import owned_parameters
    from mm_parallel.grad_buckets import state_bytes_of
    from mm_parallel.precision import dtype_under

    policy = recipe.train.precision_policy()
    zero, buckets = topo.config.zero_stage, recipe.optim.bucket_numel
    sliced = _zero3_slices(chunks, topo) if zero == 3 else {}
    params = weights = 0
    gathered = []  # the sliced weights' whole bytes, in their layers' dtype
    for chunk in chunks:
        keep = getattr(type(chunk), "_keep_in_fp32_modules", None) or ()
        for name, param, _, _ in owned_parameters(chunk):
            numel = math.prod(param.shape)
            params += numel
            size = _itemsize(dtype_under(policy, name, param, keep))
            if id(param) in sliced:
                weights += 4 * sliced[id(param)]
                gathered.append(numel * size)
            else:
                weights += numel * size
    trainable = [p for chunk in chunks for p in chunk.trainable_params()]
    grads = sum(4 * sliced[id(p)] if id(p) in sliced else math.prod(p.shape) * DTYPE_BYTES[recipe.train.grad_dtype]
                for p in trainable)
    whole = [p for p in trainable if id(p) not in sliced]
    # a ZeRO-3 slice is its own master weight: its moments alone (mm_parallel.grad_buckets)
    optimizer = (state_bytes_of(whole, topo, zero, buckets) if whole else 0) + sum(
        8 * sliced[id(p)] for p in trainable if id(p) in sliced)
    host = 0
    if recipe.optim.offload == "optimizer":  # in host memory, streamed through one bucket at a time
        host = optimizer + sum(4 * sliced[id(p)] for p in trainable if id(p) in sliced)
        optimizer = 0
    return {"params": params, "weights_bytes": weights, "grads_bytes": grads, "optimizer_bytes": optimizer,
            "optimizer_host_bytes": host,
            "optimizer_step_buffers_bytes": step_buffer_bytes(trainable, topo, buckets),
            # one layer's weight at a time, or every one kept for the step (reshard_after_forward false)
            "zero3_gather_bytes": max(gathered, default=0) if topo.config.reshard_after_forward else sum(gathered),
            # what the step reduces whole (timing: all-reduce / reduce-scatter) and what ZeRO-3 gathers per layer
            "reduced_numel": sum(math.prod(p.shape) for p in trainable if id(p) not in sliced),
            "zero3_numel": sum(math.prod(p.shape) for p in trainable if id(p) in sliced)}


def _zero3_slices(chunks, topo) -> Dict[int, int]:
    """{id(parameter): its ZeRO-3 slice's values} of the weights a ZeRO-3 run cuts."""
    from mm_parallel.sharding import sharding_of
    from mm_parallel.zero3 import sharded_weights

    # cut over each weight's gradient group (its ranks on one node under hybrid sharding), as
    # ParamSharding.flat_slice cuts it
    return {id(p): -(-math.prod(p.shape) // topo.zero3_shard(sharding_of(p).grad_sync).size)
            for chunk in chunks for _, _, p in sharded_weights(chunk, topo)}


def _itemsize(dtype) -> int:
    import mindspore as ms

    return {ms.float32: 4, ms.bfloat16: 2, ms.float16: 2}.get(dtype, 4)


def stage_layers(stack_layers: int, topo) -> int:
    """The layers of a pipelined stack one pp stage holds (all its vpp chunks; parallel.pp_layers
    when the recipe splits them unevenly)."""
    from mm_parallel.pipeline import stage_layer_ranges

    ranges = stage_layer_ranges(stack_layers, topo.pp.size, topo.config.vpp, topo.config.pp_layers)
    return sum(len(r[topo.pp.rank]) for r in ranges)


def in_flight(pp: int, vpp: int, stage: int, micro_batches: int) -> float:
    """Stage inputs kept at the worst moment, in units of one micro-batch's whole-stage input."""
    if pp == 1:
        return 0.0
    if vpp == 1:
        return float(min(pp - stage, micro_batches))
    from mm_parallel.pipeline import interleaved_order

    open_, worst = 0, 0
    for kind, _, _ in interleaved_order(pp, vpp, micro_batches, stage):
        open_ += 1 if kind == "F" else -1
        worst = max(worst, open_)
    return worst / vpp  # each chunk's input is one stage input (the same hidden) per micro-batch


# Measured here by benchmarks/plan_activation_memory.py (fp32, no recompute and full recompute,
# two depths and two lengths of each family; DESIGN.md's runtime facts):
REFERENCE_SCORE_TENSORS = 3.4  # float32 (heads x keys) tensors the reference attention keeps per query (3.3-3.5)
# ... in float32, where the CPU path's attention core has its backward written out and its softmax
# native (mm_parallel.ops.native): the probabilities, and for masked attention the additive mask
NATIVE_SCORE_TENSORS = 1.6
NATIVE_RECOMPUTED_SCORES = 2.8  # score-sized temporaries of a recomputed layer's backward with that core
BACKWARD_WORKING = 0.75  # a layer's backward holds this share of its saved set again (0.55-0.95 measured)
RECOMPUTED_WORKING = 0.5  # ... of a recomputed layer, whose set is freed as its backward goes (0.4-0.8)


def step_buffer_bytes(trainable, topo, bucket_numel: int) -> int:
    """What the optimizer step holds beyond the static bytes, after the backward has freed the
    activations: `mm_parallel.grad_buckets.step_buffer_values` (this rank's kept reduced
    gradients and one bucket's transients), fp32."""
    from mm_parallel.grad_buckets import step_buffer_values

    return 4 * step_buffer_values(trainable, topo, topo.config.zero_stage, bucket_numel) if trainable else 0


def activation_bytes(workload, recipe, topo, device: dict, micro_batches: int) -> Dict[str, int]:
    """{activations_bytes, and its parts} of one rank on ``device`` (a devices.yaml entry: fused
    kernels or the reference ones, low-precision activations stored as such or emulated in
    float32) (module docstring)."""
    par, b = topo.config, recipe.train.micro_batch_size
    tp = topo.tp.size
    tp_sp = tp if par.sequence_parallel else 1
    fused = device["fused_kernels"]
    size = DTYPE_BYTES[recipe.train.precision]
    emulated = size < 4 and device.get("emulated_low_precision", False)
    size = 4 if emulated else size
    mode, block_n = recipe.model.recompute, recipe.model.recompute_num_layers
    kept = working = boundary = 0.0
    for stack in workload.stacks:
        if not stack.trained or (not stack.pipelined and not topo.is_first_stage):
            continue
        layers = stage_layers(stack.layers, topo) if stack.pipelined else stack.layers
        t, t_sp, cp = (1, 1, 1) if stack.runs_whole else (tp, tp_sp, topo.cp.size)
        s = stack.tokens / cp
        split = stack.outside / t_sp + stack.inside / t
        if fused:  # the kernel keeps only its log-sum-exp of the scores
            whole = gradient_sized = s * b * split * size
        else:
            per_score = 0.0 if mode == "selective" else stack.heads * stack.keys / t * 4
            per_token = split / (stack.outside + stack.inside) * size
            scores = REFERENCE_SCORE_TENSORS if emulated else NATIVE_SCORE_TENSORS
            gradient_sized = s * b * (per_token * stack.reference + per_score * scores)
            # emulated bf16 / fp16 also keeps rounded copies (of the probabilities among them),
            # which have no gradients of their own
            whole = gradient_sized + (s * b * (per_token * stack.reference_emulated + per_score) if emulated else 0.0)
        kept_input = s * b * stack.hidden / t_sp * size
        recomputed = layers if mode == "full" else min(block_n or 0, layers) if mode == "block" else 0
        kept += recomputed * kept_input + (layers - recomputed) * whole
        # the layer being back-propagated: its recomputed set, and its gradients and temporaries
        # (the fp32 CPU core's backward: score-sized ones, dp and ds among them)
        native_core = not fused and not emulated
        recomputed_working = (NATIVE_RECOMPUTED_SCORES * s * b * per_score if native_core
                              else RECOMPUTED_WORKING * gradient_sized)
        working = max(working, whole + recomputed_working if recomputed else BACKWARD_WORKING * gradient_sized)
        if stack.pipelined:
            boundary = s * b * workload.boundary_hidden / tp_sp * size
    flight = in_flight(topo.pp.size, par.vpp, topo.pp.rank, micro_batches) * boundary
    logits = 0.0
    if workload.logits_vocab and topo.is_last_stage:
        logits = 2 * 4 * workload.pipelined.tokens / topo.cp.size * b * workload.logits_vocab / tp
    parts = {"activations_layers_bytes": int(kept), "activations_backward_bytes": int(working),
             "activations_in_flight_bytes": int(flight), "logits_bytes": int(logits)}
    parts["activations_bytes"] = sum(parts.values())
    return parts

