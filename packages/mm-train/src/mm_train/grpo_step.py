"""train.objective grpo in the training loop: a generation of rollouts, their training rows, the clipped update.

Every ``grpo.num_iterations`` steps a generation begins: each data-parallel rank takes its share
of the step's train.global_batch_size prompts from the stream (a prompt's G completions stay on
its rank, so a group's advantages need no communication) and completes them in place
(mm_train.rollouts: decoding under the training layout, rewards on the host). Advantages are
taken within each group (mm_parallel.grpo.group_advantages; scale_rewards batch: the global
batch's std, from one all-reduce of the rewards' moments over dp). The generation's training
rows — a prompt's sequences together with its media once (mm_data.vl.groups), micro_batch_size
prompts a micro-batch, or with data.packing one packed row of whole groups under data.max_tokens
— serve that step and the next num_iterations - 1.

Each micro-batch carries a `mm_parallel.grpo.PolicyBatch`: per target position the completion's
advantage and the aggregation weight, which makes the loop's mean over micro-batches and dp the
global batch's loss (train.loss_normalization token: w = n_r dp / T, T the global batch's
completion tokens, trl's dapo; sample: w = n_r dp / (|y| N), N its completions, trl's grpo; n_r
the rank's micro-batches); with beta > 0 the reference's log-probs (the frozen copy of the
starting weights or the policy with its adapters off: `TokenLogProbs` through the forward and
pipeline code, once per generation), and with num_iterations > 1 the sampling policy's, taken
before the generation's first update (else the update's own, detached: the ratio is 1, as trl).

The metrics (the global batch's, on every rank): ``reward`` and ``reward_std``, each function's
``reward/<name>`` and ``reward/<name>_std`` (over the completions it scored), ``kl`` and
``clip_ratio`` (the completion tokens whose ratio was clipped), ``completion_length`` and
``generation_share`` (the step's seconds spent generating, up to its backward). At a sample step
(eval.sample_every) rank 0 writes the generation's first prompts with their completions and
rewards as completions.md beside the answers (mm_train.samples).
"""

from __future__ import annotations

import os
import time
from typing import Callable, Dict, List, Optional

import mindspore as ms
import numpy as np
from mindspore import ops

from mm_parallel import comm
from mm_parallel.grpo import (
    PolicyBatch,
    TokenLogProbs,
    aggregation_weights,
    batch_moments,
    group_advantages,
    std_of_moments,
)
from mm_train import rollouts as rollouts_module
from mm_train.evaluation import recorded
from mm_train.rewards import FORMAT_PATTERN, Rewards

# Deferred imports: mm-data (optional: a missing one is named when a run needs it).


class GrpoStep:
    """See the module docstring. ``build_reference()``: the frozen reference's chunks (grpo.reference copy)."""

    def __init__(self, recipe, chunks: List, topo, task, build_reference: Callable[[], List]):
        self.grpo, self.recipe, self.topo, self.task, self.policy = recipe.grpo, recipe, topo, task, chunks
        self.settings = recipe.grpo.settings()
        self.rewards = Rewards.from_recipe(self.grpo.rewards, self.grpo.format_pattern or FORMAT_PATTERN)
        self.normalization = recipe.train.loss_normalization or "token"
        self.reference = None
        if self.grpo.beta and self.grpo.reference == "copy":
            self.reference = build_reference()
        self.generation: Optional[Dict] = None  # the current generation's rows, per-token arrays and figures
        self.batches: List[PolicyBatch] = []
        self.began = self.generating = 0.0

    # -- a generation ----------------------------------------------------------------------------

    def step_batches(self, stream, step: int) -> List[Dict]:
        """The step's training micro-batches (collated): a new generation's every num_iterations
        steps (its prompts the stream's next), else the current generation's again."""
        self.began, every = time.perf_counter(), self.grpo.num_iterations
        self.generating = 0.0
        if self.generation is None or step % every == 0:
            if step % every:
                raise ValueError(f"a grpo run with num_iterations={every} resumes at a generation's first step; "
                                 f"step {step + 1} is not one (checkpoint.every and train.steps are multiples of it)")
            prompts = next(stream)[0]
            rollouts = rollouts_module.generate(self.task, self.policy, self.topo, self.grpo, self.rewards, prompts,
                                                step // every, self.recipe.train.seed)
            self.generation = self._rows(rollouts)
            self.generating = time.perf_counter() - self.began
        return [dict(batch) for batch in self.generation["batches"]]

    def _rows(self, rollouts) -> Dict:
        """The generation's micro-batches and, per micro-batch, its per-target-position arrays."""
        from mm_data.vl import collate_groups

        copies, topo = self.grpo.num_generations, self.topo
        std = None
        if self.grpo.scale_rewards == "batch":
            std = std_of_moments(self._dp_sum(batch_moments(rollouts.rewards)))
        advantages = group_advantages(rollouts.rewards, copies, self.grpo.scale_rewards, std)
        plan = self._plan([sum(len(s["input_ids"]) for s in group) for group in rollouts.groups])
        packed = bool(getattr(self.recipe.data, "packing", False))
        batches, arrays = [], []
        completions = self._dp_sum(np.array([len(rollouts.lengths), rollouts.lengths.sum()], np.float64))
        share = len(plan) * topo.dp.size
        for prompts in plan:
            batch = collate_groups(self.task.collate, [rollouts.groups[p] for p in prompts], pack_rows=packed)
            order = [p * copies + c for c in range(copies) for p in prompts]  # copy-major (mm_data.vl.groups)
            arrays.append(_per_target(batch, advantages[order], self.normalization, completions / share))
            batches.append(batch)
        return {"batches": batches, "arrays": arrays, "rollouts": rollouts, "old": None, "ref": None}

    def _plan(self, lengths: List[int]) -> List[List[int]]:
        """The prompts of each micro-batch: micro_batch_size a micro-batch, or with data.packing rows
        of whole groups under the token budget; as many on every rank where forward passes
        communicate across dp (ZeRO-3's gathers, expert parallelism), a multiple of pp under vpp."""
        from mm_data.vl.packing import plan_rows, split_to_count, split_to_multiple

        data, par = self.recipe.data, self.topo.config
        if getattr(data, "packing", False):
            rows, _ = plan_rows(lengths, data.max_tokens or data.max_length, window=max(1, len(lengths)))
        else:
            size = self.recipe.train.micro_batch_size
            rows = [list(range(i, min(i + size, len(lengths)))) for i in range(0, len(lengths), size)]
        rows = split_to_multiple(rows, par.pp if par.vpp > 1 else 1)
        if (par.zero_stage == 3 or par.ep > 1) and self.topo.dp.size > 1:
            most = comm.all_reduce(ms.Tensor(np.array([len(rows)], np.int32)), self.topo.dp, "max").asnumpy()[0]
            rows = split_to_count(rows, int(most))
        return rows

    def _dp_sum(self, values: np.ndarray) -> np.ndarray:
        if self.topo.dp.size == 1:
            return values
        return comm.all_reduce(ms.Tensor(values.astype(np.float32)), self.topo.dp).asnumpy().astype(np.float64)

    def write_completions(self, folder: str, out: str, writer: bool, prompts: int = 4) -> List[str]:
        """completions.md in ``folder`` (``writer``: this rank writes): the current generation's
        first ``prompts`` prompts of this rank with each completion and its rewards; returns the
        file relative to ``out``."""
        if not writer or self.generation is None:
            return []
        rollouts, copies = self.generation["rollouts"], self.grpo.num_generations
        lines = ["# Completions", ""]
        for p, group in enumerate(rollouts.groups[:prompts]):
            prompt = self.task.tokenizer.decode(group[0]["input_ids"][group[0]["labels"] == -100].tolist(),
                                                skip_special_tokens=True)
            lines += [f"## {p + 1}", "", "```", prompt.strip(), "```", ""]
            for c, sequence in enumerate(group):
                row = p * copies + c
                text = self.task.tokenizer.decode(sequence["input_ids"][sequence["labels"] != -100].tolist(),
                                                  skip_special_tokens=True)
                scores = ", ".join(f"{name} {values[row]:.3g}" for name, values in rollouts.per_function.items())
                lines += [f"- reward {rollouts.rewards[row]:.3g} ({scores}): `{text.strip()}`"]
            lines.append("")
        path = os.path.join(folder, "completions.md")
        os.makedirs(folder, exist_ok=True)
        with open(path, "w") as f:
            f.write("\n".join(lines))
        return [os.path.relpath(path, out)]

    # -- the objective -------------------------------------------------------------------------

    def attach(self, batches: List[Dict]) -> List[Dict]:
        """``batches`` (forward keywords, the step's micro-batches) with ``preference``: their
        PolicyBatch, the generation's reference and sampling log-probs computed on its first step."""
        generation = self.generation
        if generation["ref"] is None and self.settings.beta:
            generation["ref"] = self._log_probs(self.reference or self.policy, batches, self.grpo.reference)
        if generation["old"] is None and self.grpo.num_iterations > 1:
            generation["old"] = self._log_probs(self.policy, batches, "policy")
        self.batches = []
        for k, (batch, arrays) in enumerate(zip(batches, generation["arrays"])):
            batch["preference"] = PolicyBatch(
                arrays["advantages"], arrays["weights"], None if generation["old"] is None else generation["old"][k],
                None if generation["ref"] is None else generation["ref"][k], self.settings)
            self.batches.append(batch["preference"])
        return batches

    def _log_probs(self, chunks, batches: List[Dict], which: str) -> List[np.ndarray]:
        """Each micro-batch's (rows, seq) per-target log-probs by ``chunks`` (forward only; the
        last pipeline stage's, zeros elsewhere, which never read them)."""
        recorders = recorded(chunks, batches, [TokenLogProbs(self.settings.temperature) for _ in batches], self.topo,
                             which == "adapters_off")
        return [r.values.asnumpy() if r.values is not None else np.zeros(a["weights"].shape, np.float32)
                for r, a in zip(recorders, self.generation["arrays"])]

    def figures(self) -> Dict:
        """The step's metrics (module docstring): (1,) tensors, equal on every rank."""
        rollouts = self.generation["rollouts"]
        host = {"reward": rollouts.rewards, **{f"reward/{k}": v for k, v in rollouts.per_function.items()}}
        names, moments = [], []
        for name, values in host.items():
            names.append(name)
            moments.append(batch_moments(values))
        lengths = rollouts.lengths.astype(np.float64)
        totals = self._dp_sum(np.concatenate(moments + [np.array([lengths.sum(), lengths.size])]))
        out = {}
        for i, name in enumerate(names):
            summed = totals[3 * i:3 * i + 3]  # (sum, sum of squares, count) over the global batch
            out[name] = summed[0] / max(summed[2], 1.0)
            out["reward_std" if name == "reward" else name + "_std"] = std_of_moments(summed)
        out["completion_length"] = totals[-2] / max(totals[-1], 1.0)
        out = {k: ms.Tensor(np.array([v], np.float32)) for k, v in out.items()}
        out.update(self._token_figures())
        share = self.generating / max(time.perf_counter() - self.began, 1e-9)
        out["generation_share"] = ms.Tensor(np.array([share], np.float32))
        return out

    def _token_figures(self) -> Dict:
        """kl and clip_ratio over the global batch's completion tokens (the last stage's sums)."""
        sums = ms.Tensor(np.zeros(3, np.float32))
        for policy in self.batches:
            if "tokens" in policy.observed:  # the last stage: the loss was computed here
                seen = policy.observed
                sums = sums + ops.stack([seen["kl"], seen["clipped"], seen["tokens"]]).astype(ms.float32)
        for group in (self.topo.pp, self.topo.cp, self.topo.dp):
            if group.size > 1:
                sums = comm.all_reduce(sums, group)
        means = sums[:2] / ops.maximum(sums[2:], 1.0)
        return {"kl": means[0:1], "clip_ratio": means[1:2]}


def _per_target(batch: Dict, advantages: np.ndarray, normalization: str, shares: np.ndarray) -> Dict[str, np.ndarray]:
    """A micro-batch's per-target-position arrays (rows, seq): each completion token's advantage
    and aggregation weight. ``advantages``: per sequence in the batch's order (rows, or a packed
    row's segments); ``shares``: (completions, completion tokens) of the global batch over n_r dp
    (mm_parallel.grpo.aggregation_weights' divisors)."""
    labels, mask = np.asarray(batch["labels"]), np.asarray(batch["attention_mask"])
    targets = np.full(labels.shape, -100, labels.dtype)
    targets[:, :-1] = labels[:, 1:]
    counted = targets != -100
    if mask.max() > 1:  # a packed row: the labelled token's segment
        sequence = np.zeros(labels.shape, np.int64)
        sequence[:, :-1] = mask[:, 1:] - 1
    else:
        sequence = np.broadcast_to(np.arange(labels.shape[0])[:, None], labels.shape)
    sequence = np.where(counted, sequence, 0)
    weights = aggregation_weights(counted, normalization, shares[0], shares[1], sequence)
    return {"advantages": np.where(counted, advantages[sequence], 0.0).astype(np.float32), "weights": weights}
