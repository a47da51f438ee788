"""What one step holds for the planner: its samples, and the micro-batches each data-parallel rank runs.

The samples are train.global_batch_size, or with train.global_batch_tokens that budget over one
sample's tokens (the workload's samples are data.max_length tokens each), at least one a rank.
Unpacked, a rank runs G / (dp b) micro-batches of b = train.micro_batch_size samples. Packed (the
workload's ``packed`` row of k samples), a micro-batch is one row: ceil(G / (dp k)) of them (a
multiple of pp under vpp, as mm_data.vl.split_to_multiple makes them), and the memory and time
models see each row as one sample of `Workload.per_row` in micro-batches of one: the recipe and
workload of `StepBatches` are what they read. With train.objective dpo a sample is a pair, two
sequences (answers or clips) as those models see them: twice the samples, packed or not; with
grpo a sample is a prompt, its num_generations completions the sequences trained.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from mm_train.recipe import check_layout


@dataclass(frozen=True)
class StepBatches:
    samples: int  # the global batch's samples
    micro_batches: int  # per data-parallel rank and step
    recipe: object  # the recipe the memory and time models read (packed: rows as samples, one a micro-batch)
    workload: object  # the workload of one of their samples (packed: a row)


def sequences_per_sample(recipe) -> int:
    """What a sample is to the models: one sequence, under train.objective dpo a pair of two, under
    grpo a prompt's num_generations completions."""
    objective = recipe.train.objective
    return 2 if objective == "dpo" else recipe.grpo.num_generations if objective == "grpo" else 1


def reference_passes(recipe) -> float:
    """Forward passes a step adds per sequence without a backward: dpo's frozen reference; grpo's
    (beta > 0) and, with num_iterations > 1, the sampling policy's before the generation's first
    update, both once per generation (a share of each of its num_iterations steps)."""
    objective = recipe.train.objective
    if objective == "dpo":
        return 1
    if objective == "grpo":
        grpo = recipe.grpo
        return ((1 if grpo.beta else 0) + (1 if grpo.num_iterations > 1 else 0)) / grpo.num_iterations
    return 0


def step_batches(recipe, workload, world: int) -> StepBatches:
    """The step of ``recipe`` on ``world`` devices (module docstring); the layout is checked first."""
    micro_batches = check_layout(recipe, world)
    par, train = recipe.parallel, recipe.train
    per_sample = sequences_per_sample(recipe)
    dp = world // (par.tp * par.cp * par.pp)
    if train.global_batch_tokens is None:
        samples = train.global_batch_size
    else:
        samples = max(dp, train.global_batch_tokens // workload.tokens_per_sample)
    row = workload.packed
    if row is None:
        if per_sample > 1:  # the models see sequences: a pair's two in each micro-batch
            as_sequences = dataclasses.replace(train, global_batch_size=samples * per_sample,
                                               micro_batch_size=train.micro_batch_size * per_sample)
            recipe = dataclasses.replace(recipe, train=as_sequences)
        return StepBatches(samples, micro_batches, recipe, workload)
    rows = math.ceil(samples * per_sample / (dp * row.samples))
    if par.vpp > 1:
        rows = math.ceil(rows / par.pp) * par.pp
    as_rows = dataclasses.replace(train, global_batch_size=rows * dp, global_batch_tokens=None, micro_batch_size=1)
    return StepBatches(samples, rows, dataclasses.replace(recipe, train=as_rows), workload.per_row())
