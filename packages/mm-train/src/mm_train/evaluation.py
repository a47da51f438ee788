"""Validation while training: the loss over a held-out split, the same number on every layout.

The held-out split is ``eval.fraction`` of the training set (`mm_data.held_out_split`: drawn by
train.seed alone, so every layout and every resumed run holds out the same samples, and training
never draws them) or the data at ``eval.path``. Its batches are fixed: the held-out samples in
index order, grouped by shape key (a video bucket), cut into batches of ``eval.batch_size``
(default micro_batch_size x dp) — a bucket's remainder smaller than a batch is left out and
counted in the log line — of which data-parallel rank r takes the r-th share, in micro-batches
of train.micro_batch_size. A diffusion family draws the noise and timestep of a validation
sample from (seed, `VALIDATION_STEP`, sample) and drops no caption, so evaluations differ only by
the weights.

    val_loss = (1 / M) sum over the M validation micro-batches of their losses

computed as training computes a step's loss: a rank's micro-batch losses summed, under pp on the
last stage (`mm_parallel.pipeline.forward_only`, given to every stage), then summed over dp
with the micro-batch count; context- and tensor-parallel ranks share their micro-batches. The
loss is the model's own (a MoE model's includes its auxiliary loss, as in training). The model
runs without tape and with ``set_train(False)`` (no LoRA dropout), then in its earlier mode.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Dict, Iterator, List

import numpy as np

from mm_train.micro_batches import MicroBatches
from mm_train.samples import inference

# Deferred imports: MindSpore and mm-parallel (the CLI starts without loading MindSpore); mm-data (optional: a
# missing one is named when a run needs it).

VALIDATION_STEP = 1 << 40  # the step of validation's draws: one no run reaches


def training_split(recipe, num_samples: int):
    """(the indices training may draw, the held-out indices): (None, None) — everything trained
    on — unless eval.fraction holds some out (`mm_data.held_out_split`)."""
    if not recipe.eval.fraction:
        return None, None
    from mm_data import held_out_split

    return held_out_split(num_samples, recipe.eval.fraction, recipe.train.seed)


def batch_size(recipe, dp: int) -> int:
    """Samples per validation batch: eval.batch_size, else one micro-batch per data-parallel rank
    (recipe.check_layout refuses a size that does not cut into whole micro-batches)."""
    return recipe.eval.batch_size or recipe.train.micro_batch_size * dp


def micro_batch_stream(task, dataset, keys, indices, prepare) -> Iterator[List[Dict]]:
    """This rank's validation micro-batches, batch by batch, as ``prepare`` turns them into forward
    keywords; the log line names the held-out samples used and left out."""
    from mm_data import BucketBatchSampler
    from mm_data.loader import build_batch

    recipe, topo = task.recipe, task.topo
    size = batch_size(recipe, topo.dp.size)
    sampler = BucketBatchSampler(len(dataset), size, topo.dp.rank, topo.dp.size, keys=keys, seed=recipe.train.seed,
                                 shuffle=False, indices=indices)
    batches = sampler.epoch_batches(0)
    if recipe.eval.max_batches:
        batches = batches[:recipe.eval.max_batches]
    held = len(dataset) if indices is None else len(indices)
    if topo.rank == 0 and not task.validation_described:
        task.validation_described = True
        print(f"mm-train: validation on {len(batches) * size} of {held} held-out samples in {len(batches)} batches of "
              f"{size} ({held - len(batches) * size} left out: buckets smaller than a batch, or eval.max_batches)",
              file=sys.stderr, flush=True)
    cut = MicroBatches(task.collate, recipe.train.micro_batch_size)
    for batch in batches:
        samples, bad = build_batch(dataset, sampler, lambda s: s, 0, sampler.local(batch), 3)
        task.record_bad_samples(bad)
        yield prepare(cut(samples))


def validation_loss(chunks, task, topo, attach=None) -> float:
    """The mean loss of the validation micro-batches (see the module docstring); ``attach``: what
    a training objective adds to each validation batch's micro-batches (mm_train.preference_step)."""
    import mindspore as ms

    from mm_parallel import comm

    total, count = 0.0, 0
    with inference(chunks):
        for batches in task.validation_batches():
            count += len(batches)
            batches = attach(batches) if attach is not None else batches
            total += sum(float(loss.asnumpy()) for loss in forward_losses(chunks, batches, topo))
    if topo.pp.size > 1:  # only the last stage has the losses
        total = float(comm.all_reduce(ms.Tensor(np.array([total], np.float32)), topo.pp).asnumpy()[0])
    if topo.dp.size > 1:
        summed = comm.all_reduce(ms.Tensor(np.array([total, count], np.float64)), topo.dp).asnumpy()
        total, count = float(summed[0]), int(round(summed[1]))
    if not count:
        raise ValueError("the held-out split forms no validation batch: raise eval.fraction, lower eval.batch_size "
                         "or give eval.path more samples")
    return total / count


def forward_losses(chunks, batches: List[Dict], topo) -> List:
    """Each micro-batch's loss from forwards alone (``batches``: forward keywords): the last
    pipeline stage's under pp (`mm_parallel.pipeline.forward_only`; other stages get none)."""
    from mm_parallel import pipeline

    if topo.pp.size > 1:
        last = chunks[-1]
        return pipeline.forward_only([c.pipeline_stage for c in chunks], [(b, b) for b in batches],
                                     lambda y, b: last.pipeline_loss(y, b), topo, with_batch=True)
    return [chunks[0](**b).loss for b in batches]


def recorded(chunks, batches: List[Dict], recorders: List, topo, adapters_off: bool = False) -> List:
    """``recorders`` — forward ``preference``s that keep what a loss reads (a reference's or the
    sampling policy's values: mm_parallel.preference.ReferencePass, mm_parallel.grpo.TokenLogProbs) —
    filled by a forward-only pass of ``batches`` in inference mode, with ``adapters_off`` the LoRA
    adapters switched off (the base model as reference, no copy); returns them."""
    from mm_parallel import lora

    off = lora.adapters_disabled(chunks) if adapters_off else contextlib.nullcontext()
    with inference(chunks), off:
        forward_losses(chunks, [{**b, "preference": r} for b, r in zip(batches, recorders)], topo)
    return recorders


def due(every: int, step: int, last: int) -> bool:
    """Whether step (1-based) is one of every-th steps (or the last step) of a schedule; 0: never."""
    return bool(every) and (step % every == 0 or step == last)

