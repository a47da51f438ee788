"""Qwen2.5-VL under a layout vs one process, inside one msrun launch.

Every case loads the same transformers checkpoint with from_pretrained under its topology (each
rank reading its shard), applies the plan (recompute, LoRA with PEFT adapters read from
``path/adapters``, freezing), then runs two DistributedOptimizer steps on a batch of two
image+text samples, compared with one process by mm_parallel.testing.equivalence.
"""

from __future__ import annotations

import json
import os

import numpy as np
from helpers.qwen_vl_reference import IMAGE, PATCH_DIM, merged, placeholder, with_types_and_labels


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
    """Part ``index`` of ``parts`` equal slices of the samples (and their images and videos: every
    sample holds as many of each, of the same grids)."""
    samples = inputs["input_ids"].shape[0]
    per = samples // parts
    lo, hi = index * per, (index + 1) * per
    media = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))
    out = {k: v[lo:hi] for k, v in inputs.items() if k not in sum(media, ())}
    for pixels, grids in media:
        if grids in inputs:
            rows = len(inputs[grids]) // samples  # grid rows per sample
            patches = int(np.prod(inputs[grids][:rows], axis=1).sum())
            out[pixels] = inputs[pixels][lo * patches:hi * patches]
            out[grids] = inputs[grids][lo * rows:hi * rows]
    return out


def model_class(path):
    """The mm_models_vl class of the checkpoint at ``path`` (its config.json's model_type)."""
    import mm_models_vl

    with open(os.path.join(path, "config.json")) as f:
        model_type = json.load(f)["model_type"]
    return getattr(mm_models_vl, {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                                  "qwen3_vl": "Qwen3VLForConditionalGeneration",
                                  "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
                                  "qwen2_5_omni_thinker": "Qwen2_5OmniThinkerForConditionalGeneration"}[model_type])


def build(path, topo, case):
    """This rank's model chunks (one without virtual pipeline stages), loaded and planned (the
    Qwen VL models share one plan)."""
    from mm_models_vl.qwen2_5_vl.parallel_plan import LoraConfig, parallelize
    chunks = []
    split = case.get("pipeline_num_layers") if topo.pp.size > 1 else None  # the one-process reference: whole
    for chunk in range(topo.config.vpp):
        model = model_class(path).from_pretrained(path, topology=topo, chunk=chunk, pipeline_num_layers=split)
        parallelize(model, recompute=case.get("recompute", "none"), recompute_num_layers=1,
                    lora=LoraConfig(r=4, alpha=8.0) if case.get("lora") else None, freeze=case.get("freeze", ()))
        if case.get("lora"):
            model.load_adapter(os.path.join(path, "adapters"))
        chunks.append(model)
    return chunks


def spec():
    from mm_parallel.testing.equivalence import ModelSpec

    return ModelSpec(build=build, split=sample_part, samples=lambda b: b["input_ids"].shape[0], save=_save)


def dpo_batch(seed: int = 1):
    """Two preference pairs as four rows of one structure (image + text, length 32), rows
    [pair 0 chosen, pair 0 rejected, pair 1 chosen, pair 1 rejected], answers the last 6 / 4
    tokens, with fixed reference log-probs: `preference` (mm_parallel.preference.PairedBatch)."""
    from mm_parallel.preference import Settings

    rng = np.random.default_rng(seed)
    grid = (1, 4, 8)
    prompts = [rng.integers(3, 240, 5).tolist() + placeholder(IMAGE, merged(grid)) + rng.integers(3, 240, 11).tolist()
               for _ in range(2)]
    rows = [prompt + rng.integers(3, 240, 6).tolist() for prompt in prompts for _ in range(2)]
    pictures = rng.standard_normal((2, int(np.prod(grid)), PATCH_DIM)).astype(np.float32)
    inputs = {"input_ids": np.array(rows, np.int64),
              "pixel_values": np.repeat(pictures, 2, axis=0).reshape(-1, PATCH_DIM),  # a pair shares its picture
              "image_grid_thw": np.array([grid] * 4, np.int64)}
    inputs = with_types_and_labels(inputs)
    answer = np.array([6, 4, 6, 4])  # each row's answer tokens: the rest of the row is the prompt
    for row, length in enumerate(answer):
        inputs["labels"][row, :32 - length] = -100
    inputs["preference"] = _pairs(rng.normal(-30.0, 3.0, 4).astype(np.float32), answer, Settings("sigmoid", 0.5))
    return inputs


def _pairs(reference, answer, settings):
    """The PairedBatch of rows [chosen, rejected, chosen, rejected, ...] (a micro-batch's loss the
    mean over its pairs: the pipeline schedule and dp average the micro-batches')."""
    from mm_parallel.preference import PairedBatch

    chosen, rejected = np.arange(0, len(answer), 2), np.arange(1, len(answer), 2)
    return PairedBatch(chosen, rejected, reference[chosen], reference[rejected], answer[chosen], answer[rejected],
                       len(chosen), float(answer[chosen].sum()), settings)


def dpo_spec():
    """`spec` for `dpo_batch`: parts of whole pairs, each with its own PairedBatch."""
    from mm_parallel.testing.equivalence import ModelSpec

    def split(inputs, index, parts):
        pairs = inputs["preference"]
        part = sample_part({k: v for k, v in inputs.items() if k != "preference"}, index, parts)
        rows = slice(index * len(pairs.chosen) // parts, (index + 1) * len(pairs.chosen) // parts)
        reference = np.stack([pairs.reference_chosen[rows], pairs.reference_rejected[rows]], 1).reshape(-1)
        answer = np.stack([pairs.chosen_tokens[rows], pairs.rejected_tokens[rows]], 1).reshape(-1)
        part["preference"] = _pairs(reference, answer, pairs.settings)
        return part

    return ModelSpec(build=build, split=split, samples=lambda b: len(b["preference"].chosen), save=_save)


def run_dpo_cases(path, cases):
    """`run_parallel_cases` with DPO's loss on `dpo_batch`'s pairs; ``"dpo_losses"``: how many
    micro-batch losses were the pairs' (so that a forward ignoring `preference` cannot pass)."""
    from mm_parallel.preference import PairedBatch
    from mm_parallel.testing.equivalence import run_cases

    calls, loss = [], PairedBatch.loss
    PairedBatch.loss = lambda self, logps: calls.append(1) or loss(self, logps)
    try:
        results = run_cases(dpo_spec(), path, cases, dpo_batch())
    finally:
        PairedBatch.loss = loss
    return {**results, "dpo_losses": len(calls)}


def grpo_batch(seed: int = 2):
    """Two prompts with two completions each as four rows of one structure (image + text, length
    32), rows [prompt 0 completion 0, prompt 0 completion 1, prompt 1 ...], the completions the last
    6 / 4 tokens, with fixed advantages and sampling / reference log-probs: `preference`
    (mm_parallel.grpo.PolicyBatch; each completion's mean over its tokens, averaged over the rows)."""
    from mm_parallel.grpo import PolicyBatch, Settings, aggregation_weights

    rng = np.random.default_rng(seed)
    inputs = dpo_batch(seed)
    labels = inputs["labels"]
    counted = np.zeros(labels.shape, bool)
    counted[:, :-1] = labels[:, 1:] != -100
    at_targets = lambda values: np.where(counted, values, 0.0).astype(np.float32)  # noqa: E731
    inputs["preference"] = PolicyBatch(
        at_targets(np.array([0.9, -0.3, 1.2, 0.5])[:, None]),  # a positive mean: the loss does not cancel
        aggregation_weights(counted, "sample", len(labels), counted.sum()),
        at_targets(rng.normal(-5.5, 0.3, labels.shape)), at_targets(rng.normal(-5.5, 0.5, labels.shape)),
        Settings(epsilon=0.2, epsilon_high=0.28, beta=0.05))
    return inputs


def grpo_spec():
    """`spec` for `grpo_batch`: parts of whole prompts, each with its rows' PolicyBatch, whose
    weights are its own completions' mean (the layout averages the parts)."""
    import dataclasses

    from mm_parallel.testing.equivalence import ModelSpec

    def split(inputs, index, parts):
        policy, rows = inputs["preference"], len(inputs["input_ids"])
        part = sample_part({k: v for k, v in inputs.items() if k != "preference"}, index, parts)
        mine = slice(index * rows // parts, (index + 1) * rows // parts)
        part["preference"] = dataclasses.replace(
            policy, advantages=policy.advantages[mine], weights=policy.weights[mine] * parts,
            old_logps=policy.old_logps[mine], ref_logps=policy.ref_logps[mine], observed={})
        return part

    return ModelSpec(build=build, split=split, samples=lambda b: len(b["input_ids"]), save=_save)


def run_grpo_cases(path, cases):
    """`run_parallel_cases` with GRPO's loss on `grpo_batch`'s completions; ``"grpo_losses"``: how
    many micro-batch losses were the completions' (a forward ignoring `preference` cannot pass)."""
    from mm_parallel.grpo import PolicyBatch
    from mm_parallel.testing.equivalence import run_cases

    calls, loss = [], PolicyBatch.model_loss
    PolicyBatch.model_loss = lambda self, *args: calls.append(1) or loss(self, *args)
    try:
        results = run_cases(grpo_spec(), path, cases, grpo_batch(),
                            reference_key=lambda case: (bool(case.get("lora")),))
    finally:
        PolicyBatch.model_loss = loss
    return {**results, "grpo_losses": len(calls)}


def _save(chunks, folder):
    from mm_models_vl.qwen2_5_vl.parallel_plan import LoraConfig

    chunks[0].save_pretrained(folder, chunks)
    chunks[0].save_adapter(os.path.join(folder, "adapters"), LoraConfig(r=4, alpha=8.0), chunks)


def run_parallel_cases(path, cases):
    """cases: {name: {"layout": ParallelConfig kwargs, "recompute", "lora", "freeze", "checkpoint":
    sub-folder of path}} -> mm_parallel.testing.equivalence.run_cases' results."""
    from mm_parallel.testing.equivalence import run_cases

    return run_cases(spec(), path, cases, batch(),
                     reference_key=lambda case: (bool(case.get("lora")), tuple(case.get("freeze", ()))))


def save_under_layouts(path, out, layouts):
    """layouts: {name: (ParallelConfig kwargs, checkpoint sub-folder)} -> {name: [problems]}
    (mm_parallel.testing.equivalence.save_under_layouts)."""
    from mm_parallel.testing.equivalence import save_under_layouts as save_all

    return save_all(spec(), path, out, layouts)
