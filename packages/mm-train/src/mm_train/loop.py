"""The training loop every recipe family shares; a *task* supplies its model and data.

One step = the global batch of the recipe, cut into micro-batches of ``micro_batch_size``:
micro-batch k holds samples [k m, (k + 1) m) of the step's batch and data-parallel rank r runs
micro-batches [r n, (r + 1) n), n = global / (m dp). Each rank sums the gradients of its
micro-batches and divides by n; the optimizer averages over dp. The loss of a step is the mean of
its micro-batches' losses — the same numbers under any layout of the same recipe. Under pp the
micro-batches run through the 1F1B schedule; context-parallel ranks share their micro-batches
(the models cut the sequence themselves). With virtual pipeline stages (vpp > 1) a rank holds one
model chunk per virtual stage and the step runs the interleaved 1F1B schedule.

With ``profile.enable`` mm-profiling's `StepProfiler` collects steps start_step..end_step on
the chosen ranks (trace under OUT/profile/rank_<r> unless profile.save_path says).
Rank 0 writes OUT/metrics.jsonl (step, loss, grad_norm, lr, samples_per_s, tokens_per_s, mfu,
mem_bytes, skipped; val_loss every ``eval.every`` steps: mm_train.evaluation; the sample files
every ``eval.sample_every`` steps: mm_train.samples) — and with ``logging.tensorboard`` the same
rows as TensorBoard events (mm_train.tensorboard_log) —, draws the progress line and, at the
end, OUT/loss.png with the validation loss beside the training loss. A step whose loss or
gradient is not finite (on any rank) is skipped — no update — and counted;
``train.max_nonfinite_steps`` skipped steps in a row stop the run with an error.

The task (`mm_train.task.Task`, made by the recipe's family: mm_train.registry) supplies the
model class, its plan and the data; MFU counts the model's FLOPs on the first micro-batch. With
train.objective dpo a sample is a preference pair and `mm_train.preference_step` gives each
micro-batch the frozen reference's values and the pairs' divisors; with grpo a sample is a prompt
and `mm_train.grpo_step` makes the step's micro-batches from its rollouts (their metrics join the
rows).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Callable, Dict, List, Optional

import mindspore as ms
import numpy as np
from mindspore import ops

import mm_parallel
import mm_parallel.activation_offload
import mm_parallel.precision
import mm_parallel.zero3
from mm_parallel import ParallelConfig, comm, pipeline
from mm_parallel.comm.watchdog import HANG_EXIT_CODE, Watchdog
from mm_parallel.moe import routing_metrics
from mm_parallel.ops import low_precision
from mm_parallel.ops.device import as_type, use_fused
from mm_parallel.tensor_parallel import seed_parameters
from mm_parallel.topology import Topology
from mm_train import checkpoint, evaluation, node_disks, run_folder, samples, trackers
from mm_train.grpo_step import GrpoStep
from mm_train.loss_share import with_loss_divisor
from mm_train.preference_step import PreferenceStep
from mm_train.recipe import Recipe, check_layout
from mm_train.step_rows import Progress, Rows, finite
from mm_train.task import Task

# Deferred imports: matplotlib, mm-profiling (optional: a missing one is named when a run needs it).

TRAIN_FLOPS_FACTOR = 3  # forward + backward (twice the forward)


def build_model(task: Task, recipe: Recipe, topo, resume_from: Optional[str] = None, disks=None):
    """(the model chunks this rank holds — one per virtual pipeline stage, usually one — and the
    LoRA config or None): from the checkpoint being resumed, the recipe's path, or its inline
    config (random weights); then the task's plan (recompute, LoRA, freezing) on each chunk.
    ``disks``: who shares a disk (`mm_train.node_disks`; default one shared file system)."""
    spec = recipe.model
    source = os.path.join(resume_from, "model") if resume_from else spec.path
    if not source and topo.pp.size > 1:
        # a pipeline stage draws only its own parameters, which would differ from the whole model's
        # draw: rank 0 (each node's first rank on node-local disks) draws the whole model once,
        # every stage loads its part of it
        source = _initial_weights(task, recipe, topo, disks or node_disks.shared(topo))
    if source:
        chunks = [task.model_class.from_pretrained(source, topo, chunk=c, **spec.config_overrides)
                  for c in range(topo.config.vpp)]
    else:
        seed_parameters(recipe.train.seed)  # the draw depends on the seed only, not on what the data drew
        chunks = [task.model_class(task.inline_config(), topo)]
    lora = task.lora_config(**spec.lora.options()) if spec.lora else None
    policy = recipe.train.precision_policy()
    for chunk in chunks:
        mm_parallel.precision.apply(chunk, policy)
        task.plan(chunk, lora)
        if lora is not None and resume_from:
            chunk.load_adapter(os.path.join(resume_from, "adapters"))
    if topo.config.zero_stage == 3:  # after the plan: LoRA and freezing decide what trains
        _shard_weights(chunks, topo)
    return chunks, lora


def _frozen(chunks):
    """``chunks`` with no parameter trained (a reference model)."""
    for chunk in chunks:
        for parameter in chunk.get_parameters():
            parameter.requires_grad = False
    return chunks


def _shard_weights(chunks, topo) -> None:
    """ZeRO-3: each chunk's linear weights cut into flat slices (mm_parallel.zero3), said once."""
    done = [mm_parallel.zero3.shard_parameters(chunk, topo) for chunk in chunks]
    if topo.rank == 0:
        sharded, numel = sum(d.sharded for d in done), sum(d.sharded_numel for d in done)
        whole, rest = sum(d.whole for d in done), sum(d.whole_numel for d in done)
        experts = f" (MoE experts 1/{topo.edp.size})" if topo.edp.size != topo.dp_cp.size else ""
        print(f"mm-train: ZeRO-3 holds 1/{topo.dp_cp.size}{experts} of {sharded} weights ({numel:,} values); {whole} "
              f"trained parameters ({rest:,} values) stay whole (under parallel.zero3_min_numel="
              f"{topo.config.zero3_min_numel:,}, norms, biases, convolutions, tied)", file=sys.stderr)


@contextlib.contextmanager
def _reading_checkpoint(folder: Optional[str], disks):
    """On node-local disks a rank reads only its own node's part of a checkpoint: a file it needs
    that another node holds (the layout or the node order changed) is named with what to do."""
    try:
        yield
    except (FileNotFoundError, KeyError) as error:
        if folder is None or disks.shared:
            raise
        elsewhere = checkpoint.missing_here(folder)
        raise ValueError(f"checkpoint.shared_fs is false and this node ({disks.node}) holds only its own part of "
                         f"{folder}: {error}. Its other files are on the other nodes' disks "
                         f"({'; '.join(elsewhere[:3]) or 'none listed'}): resume with the layout and node order that "
                         "wrote it, or copy every node's files into one folder") from error


def _initial_weights(task: Task, recipe: Recipe, topo, disks) -> str:
    """Rank 0 (on node-local disks each node's first rank) draws the whole model (as one process
    would) into output_dir/initial_weights."""
    folder = os.path.join(recipe.output_dir, "initial_weights")
    if disks.folder_writer:
        solo = Topology.build(ParallelConfig(), 1, 0)
        seed_parameters(recipe.train.seed)
        task.model_class(task.inline_config(), solo).save_pretrained(folder)
    comm.barrier(topo.world)
    return folder


def _loss_curve(metrics: List[Dict], path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the curve is a convenience; metrics.jsonl has the numbers
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([m["step"] for m in metrics], [float("nan") if m["loss"] is None else m["loss"] for m in metrics],
            label="training")
    held_out = [m for m in metrics if "val_loss" in m]
    if held_out:
        ax.plot([m["step"] for m in held_out], [float("nan") if m["val_loss"] is None else m["val_loss"]
                                                for m in held_out], "o-", label="validation")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("training and validation loss" if held_out else "training loss")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def train(recipe: Recipe, make_task: Optional[Callable[..., Task]] = None, progress: bool = True,
          resume: bool = False, resume_from: Optional[str] = None, overwrite: bool = False) -> List[Dict]:
    """Run the recipe's task (``make_task(recipe, topology)``, by default its family's); returns
    the metrics of the steps run (rank 0 also writes them). With ``resume``, continue from the
    newest checkpoint in output_dir that verifies (if any), whatever layout wrote it; with
    ``resume_from``, from that checkpoint folder. An output_dir holding another run's checkpoints
    or metrics is refused unless resuming or ``overwrite`` (mm_train.run_folder). The process's
    kernel compute dtype (set by the run's precision) is restored afterwards."""
    before = low_precision.compute_dtype()
    try:
        return _train(recipe, make_task, progress, resume, resume_from, overwrite)
    finally:
        low_precision.set_compute_dtype(before)


def _peak_flops(device: str, precision: str):
    """The device peak MFU is reported against (mm_profiling.throughput.step_peak_flops): the
    host's measured rate on CPU, cluster.device's table entry on Ascend (none known: no MFU)."""
    from mm_profiling.throughput import step_peak_flops

    target = ms.get_context("device_target")
    peak = step_peak_flops(target, device, precision)
    if peak is None:
        print(f"mm-train: no peak FLOP/s for cluster.device={device!r} at {precision} "
              "(mm_profiling.throughput.PEAK_FLOPS): MFU is not reported", file=sys.stderr)
    return peak


def _train(recipe, make_task, progress, resume, resume_from, overwrite) -> List[Dict]:
    from mm_profiling.throughput import Throughput, step_memory_bytes

    topo = mm_parallel.initialize(recipe.parallel)
    device_target = ms.get_context("device_target")
    check_layout(recipe, topo.world_size)
    ms.set_seed(recipe.train.seed)
    task = (make_task or recipe.family.task)(recipe, topo)
    samples.check(task, recipe)
    out = recipe.output_dir
    disks = node_disks.find(topo, recipe.checkpoint.shared_fs)
    run = run_folder.start(recipe, task, topo, resume, resume_from, overwrite, disks)
    resume_from = run.resume_from
    with _reading_checkpoint(resume_from, disks):
        chunks, lora = build_model(task, recipe, topo, resume_from, disks)
    moe = any(mm_parallel.moe.moe_layers(chunk) for chunk in chunks)  # looked up once, not per step
    policy = recipe.train.precision_policy()
    optimizer = mm_parallel.DistributedOptimizer(chunks[0] if len(chunks) == 1 else chunks,
                                                 policy.optimizer_config(recipe.optim), topo)
    with _reading_checkpoint(resume_from, disks):
        first = checkpoint.load_optimizer(resume_from, chunks, optimizer) if resume_from else 0
    params = [p for chunk in chunks for p in chunk.trainable_params()]
    objective = None  # dpo: the reference and the pairs (mm_train.preference_step); grpo: rollouts (grpo_step)
    reference = lambda: _frozen(build_model(task, recipe, topo, None, disks)[0])  # noqa: E731 (the starting weights)
    if recipe.train.objective == "dpo":
        objective = PreferenceStep(recipe, chunks, topo, reference)
        objective.start(task, out, first, disks.folder_writer)
    elif recipe.train.objective == "grpo":
        objective = GrpoStep(recipe, chunks, topo, task, reference)
    # the loss times the loss scale (1 unless fp16 / a static scale) is what is differentiated
    grad_fn = ms.value_and_grad(lambda batch: optimizer.scale_loss(chunks[0](**batch).loss), None, params)

    writer = topo.rank == 0
    if writer:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "recipe.json"), "w") as f:
            json.dump(recipe.to_dict(), f, indent=2, default=str)
    bar = Progress(recipe.train.steps, progress and writer)
    global_batch = recipe.train.global_batch_size or 0  # a token budget's batches say theirs (batch_samples)
    log = _metrics_log(os.path.join(out, "metrics.jsonl"), first) if writer else None
    board = trackers.open_for(recipe, first, writer)  # TensorBoard and the trackers the recipe names
    every = recipe.checkpoint.every
    profiler = _profiler(recipe.profile, topo.rank)
    rows = Rows(recipe, optimizer, global_batch // topo.dp.size, topo.dp.size, log, board, bar,
                lambda: step_memory_bytes(device_target)["bytes"])
    on_device = use_fused()  # the device path: a step's figures are read when its row is written (step_rows)
    transfers = mm_parallel.stage_io.TransferPlan()  # pipeline headers cross once per micro-batch shape
    stream = task.stream(first)
    normalization, packed = task.loss_normalization(), task.packed()
    offload = mm_parallel.activation_offload.ActivationOffload() if recipe.train.activation_offload else None
    watchdog = _watchdog(recipe.train.collective_timeout, out, topo)
    try:
        for step in range(first, recipe.train.steps):
            comm.watchdog.set_step(step + 1)
            if profiler is not None:
                profiler.before_step(step + 1)
            start = time.perf_counter()
            batches = objective.step_batches(stream, step) if objective is not None else next(stream)
            if rows.meter is None:
                flops = TRAIN_FLOPS_FACTOR * task.flops_per_sample(chunks[0], batches[0])
                rows.meter = Throughput(flops_per_sample=flops,
                                        peak_flops=_peak_flops(recipe.cluster.device, recipe.train.precision),
                                        world_size=topo.world_size, dp_size=topo.dp.size)
            tokens = sum(task.tokens(b) for b in batches)
            packing = _packing_figures(tokens, sum(b["input_ids"].size for b in batches),
                                       sum(task.samples(b) for b in batches), topo) if packed else {}
            batches = [task.model_inputs(b) for b in batches]
            if objective is not None:
                batches = objective.attach(batches)
            elif normalization:
                batches = with_loss_divisor(batches, chunks[0], normalization, topo)
            with offload.saving() if offload is not None else contextlib.nullcontext():
                losses, grads = _losses_and_grads(chunks, params, grad_fn, batches, topo, optimizer,
                                                  policy.accumulate_dtype, transfers)
            if offload is not None and step == first and topo.rank == 0:
                print(f"mm-train: activation offload moved {offload.offloaded_bytes / 2 ** 20:,.1f} MiB of saved "
                      "tensors to host memory in the first step", file=sys.stderr)
            figures = _step_loss(losses, tokens, optimizer, topo, on_device)
            if objective is not None:
                figures.update(objective.figures())
            if on_device:  # a non-finite loss skips the step inside the optimizer, decided on the device
                stats = optimizer.step(grads, finite_loss=ops.isfinite(figures["loss"]))
            elif np.isfinite(figures["loss"]):
                stats = optimizer.step(grads)
            else:  # skipped like the optimizer skips a non-finite gradient: the schedule still advances
                stats = {"lr": optimizer.lr_at(optimizer.iteration), "grad_norm": float("nan"), "skipped": True,
                         "overflow": False, "loss_scale": optimizer.loss_scale}
                optimizer.iteration += 1
            for chunk in chunks if moe else ():  # aux-loss-free MoE balancing (nothing without expert biases)
                mm_parallel.moe.update_expert_biases(chunk)
            if profiler is not None:
                profiler.after_step(step + 1)
            rows.add({**figures, **stats, **packing, "step": step + 1, "seconds": time.perf_counter() - start})
            saving = every and ((step + 1) % every == 0 or step + 1 == recipe.train.steps)
            if not on_device or saving or _row_due(recipe, step + 1):
                routing = _routing_metrics(chunks) if moe else {}
                extra = {"moe": routing} if routing else {}
                extra.update(_evaluate(recipe, task, chunks, topo, step + 1, bar, board, watchdog, objective))
                rows.write(extra)
            if saving:
                with watchdog.paused():  # the others wait while rank 0 writes and hashes
                    checkpoint.save(out, step + 1, chunks, optimizer, topo, lora, recipe.checkpoint.keep,
                                    data_state=task.position(step + 1), model_dtype=recipe.checkpoint.save_dtype,
                                    run=run.record, disks=disks)
    finally:
        watchdog.stop()
        stream.close()
        if profiler is not None:
            profiler.close()
        if log is not None:
            log.close()
        if board is not None:
            board.close()
    _record_bad_samples(task, topo, out)
    if writer:  # the whole run's curve: a resumed run's log holds the steps before it too
        with open(os.path.join(out, "metrics.jsonl")) as f:
            _loss_curve([json.loads(line) for line in f if line.strip()], os.path.join(out, "loss.png"))
    return rows.metrics


def _evaluate(recipe, task, chunks, topo, step: int, bar, board, watchdog, objective=None) -> Dict:
    """What step ``step`` adds to its metrics row: the validation loss every eval.every steps
    (``val_loss``; dpo: the held-out pairs' loss against the reference), the sample files every
    eval.sample_every steps (``samples``); each noted with its time on the progress output."""
    added = {}
    if evaluation.due(recipe.eval.every, step, recipe.train.steps):
        began = time.perf_counter()
        attach = None if objective is None else (lambda batches: objective.attach(batches, whole_batch=False))
        added["val_loss"] = finite(evaluation.validation_loss(chunks, task, topo, attach))
        shown = "nan" if added["val_loss"] is None else f"{added['val_loss']:.4f}"
        bar.note(f"step {step}: val_loss {shown} ({time.perf_counter() - began:.1f} s)")
    if evaluation.due(recipe.eval.sample_every, step, recipe.train.steps):
        began = time.perf_counter()
        with watchdog.paused():  # the others wait while rank 0 writes the files
            added["samples"] = samples.write(task, chunks, topo, step, board)
            if hasattr(objective, "write_completions"):  # grpo: some of the step's rollouts beside them
                added["samples"] += objective.write_completions(samples.folder(recipe, step), recipe.output_dir,
                                                                topo.rank == 0)
        bar.note(f"step {step}: {len(recipe.eval.prompts)} samples in {samples.folder(recipe, step)} "
                 f"({time.perf_counter() - began:.1f} s)")
    return added


BAD_SAMPLES = "bad_samples.jsonl"


def _record_bad_samples(task, topo, out: str) -> None:
    """OUT/bad_samples.jsonl: every sample any rank skipped, {"source", "reason"} per line, once
    each (a resumed run adds to the rows already there). The ranks send theirs to rank 0 (a
    gather: no shared disk needed), which writes the file."""
    mine = "".join(json.dumps({"source": s, "reason": r}) + "\n" for s, r in getattr(task, "bad_samples", list)())
    parts = comm.all_gather_bytes(mine.encode(), topo.world)
    if topo.rank != 0:
        return
    path, rows, lines = os.path.join(out, BAD_SAMPLES), {}, []
    if os.path.exists(path):
        with open(path) as f:
            lines = f.read().splitlines()
    for line in lines + [line for part in parts for line in part.decode().splitlines()]:
        if line.strip():
            row = json.loads(line)
            rows.setdefault(row["source"], row)
    if rows:
        os.makedirs(out, exist_ok=True)
        with open(path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows.values())


def bad_sample_count(out: str) -> int:
    """How many samples OUT/bad_samples.jsonl records (0 without the file)."""
    path = os.path.join(out, BAD_SAMPLES)
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if line.strip())


def _watchdog(timeout: float, out: str, topo):
    """The collective watchdog of the training steps (mm_parallel.comm.watchdog): a wait past
    train.collective_timeout ends the run with who waited where and which rank never came
    (heartbeats in OUT/logs/heartbeat). Inactive on one process or with a timeout of 0."""
    def stop(report: str) -> None:
        print(f"mm-train: the run stopped: collective timeout: {report}", file=sys.stderr, flush=True)
        os._exit(HANG_EXIT_CODE)

    watchdog = Watchdog(topo.rank, timeout or 1.0, os.path.join(out, "logs", "heartbeat"), on_hang=stop)
    if topo.world_size > 1 and timeout > 0:
        watchdog.start()
    return watchdog


def _profiler(profile, rank: int):
    """mm-profiling's step profiler for the recipe's profile section (steps count from 1; the
    trace goes to profile.save_path, default OUT/profile), or None when profiling is off."""
    if profile is None or not profile.enable:
        return None
    from mm_profiling.control import StepProfiler

    return StepProfiler(profile, rank=rank)


def _losses_and_grads(chunks, params, grad_fn, batches, topo, optimizer, grad_dtype, transfers=None):
    """(micro-batch losses times the loss scale — on the last pipeline stage only under pp — and
    the gradients of their mean for this rank's parameters, in ``params`` order, summed over the
    micro-batches in ``grad_dtype``)."""
    if topo.pp.size > 1:
        micro, last = [(b, b) for b in batches], chunks[-1]
        loss_fn = lambda y, batch: optimizer.scale_loss(last.pipeline_loss(y, batch))  # noqa: E731
        if len(chunks) == 1:
            return pipeline.train_step_1f1b(last.pipeline_stage, params, micro, loss_fn, topo, with_batch=True,
                                            grad_dtype=grad_dtype, plan=transfers)
        losses, per_chunk = pipeline.train_step_interleaved(
            [c.pipeline_stage for c in chunks], [c.trainable_params() for c in chunks], micro, loss_fn,
            topo, with_batch=True, grad_dtype=grad_dtype, plan=transfers)
        return losses, [g for chunk in per_chunk for g in chunk]
    total, losses = None, []
    for batch in batches:
        loss, grads = grad_fn(batch)
        losses.append(loss if use_fused() else float(loss.asnumpy()))
        grads = [as_type(g, grad_dtype) for g in grads]
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    return losses, [g * (1.0 / len(batches)) for g in total] if len(batches) > 1 else total


def _packing_figures(tokens: int, positions: int, samples: int, topo) -> Dict:
    """A packed step's ``padding_fraction`` (the computed positions, over dp, that are padding),
    ``tokens_max_over_mean`` (the busiest dp rank's real tokens over the mean) and
    ``batch_samples`` (the global batch's samples): one all-gather over dp, (1,) tensors read with
    the step's other figures (step_rows)."""
    local = ms.Tensor(np.array([tokens, positions, samples], np.float32))
    gathered = comm.all_gather(local[None], topo.dp) if topo.dp.size > 1 else local[None]
    real, computed = gathered[:, 0], gathered[:, 1]
    return {"padding_fraction": (1 - real.sum() / computed.sum()).reshape(1),
            "tokens_max_over_mean": (real.max() / real.mean()).reshape(1),
            "batch_samples": gathered[:, 2].sum().reshape(1)}


def _row_due(recipe, step: int) -> bool:
    """Whether step ``step`` writes a metrics row on the device path: a log step, an evaluation
    or sample step, the last step (checkpoints too: the loop adds them)."""
    return (step % recipe.train.log_every == 0 or step == recipe.train.steps
            or evaluation.due(recipe.eval.every, step, recipe.train.steps)
            or evaluation.due(recipe.eval.sample_every, step, recipe.train.steps))


def _step_loss(losses, tokens: int, optimizer, topo, on_device: bool) -> Dict:
    """{"loss": the step's loss (the mean of its micro-batches', unscaled, the same on every rank),
    "tokens": the step's tokens over dp}: host numbers on the CPU path, unread (1,) tensors on the
    device path. Ranks that see no loss (pipeline stages before the last) get it from the last."""
    if not on_device:
        loss = float(np.mean(losses)) / optimizer.loss_scale if losses else 0.0
        if topo.pp.size > 1:  # only the last stage sees the loss: give it to every stage
            loss = float(comm.all_reduce(ms.Tensor(np.array([loss], np.float32)), topo.pp).asnumpy()[0])
        if topo.dp.size > 1:  # a nan on any rank makes the sum nan everywhere: every rank agrees
            summed = comm.all_reduce(ms.Tensor(np.array([loss, tokens], np.float32)), topo.dp).asnumpy()
            loss, tokens = float(summed[0]) / topo.dp.size, int(summed[1])
        return {"loss": loss, "tokens": tokens}
    loss = pipeline.mean_loss(losses).reshape(1) if losses else ms.Tensor(np.zeros(1, np.float32))
    loss = optimizer.unscale_loss(loss)
    if topo.pp.size > 1:
        loss = comm.all_reduce(loss, topo.pp)
    both = ops.concat([loss, ms.Tensor(np.array([tokens], np.float32))])
    if topo.dp.size > 1:
        both = comm.all_reduce(both, topo.dp)
        both = both / ms.Tensor(np.array([topo.dp.size, 1], np.float32))
    return {"loss": both[0:1], "tokens": both[1:2]}


def _routing_metrics(chunks) -> Dict:
    """Per MoE layer of this rank's chunks (mm_parallel.moe.routing_metrics), keyed by the layer's
    module path in the whole model; empty without MoE layers."""
    out = {}
    for chunk in chunks:
        out.update(routing_metrics(chunk, names=chunk.global_name))
    return out


def _metrics_log(path: str, first: int):
    """metrics.jsonl opened for appending after the rows of steps <= ``first`` (a resumed run
    rewrites the steps after its checkpoint)."""
    rows = []
    if first and os.path.exists(path):
        with open(path) as f:
            rows = [line for line in f if line.strip() and json.loads(line)["step"] <= first]
    log = open(path, "w")
    log.writelines(rows)
    return log


