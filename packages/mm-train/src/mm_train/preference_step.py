"""train.objective dpo in the training loop: the frozen reference, each micro-batch's pairs, the metrics.

A micro-batch of P pairs holds 2P sequences, the P chosen ones first (mm_data.vl.pairs: padded
rows or one packed row, the pair's media through the towers once). Before the policy's forward
the reference gives each sequence's log-probability (`mm_parallel.preference.LogProbsOnly` as the
forward's ``preference``: the policy's own forward and pipeline code, forward only, on the last
pipeline stage): ``dpo.reference`` copy is a second, frozen model built from the starting
weights (the model folder or the seed's draw, sharded like the policy: tp, pp, ZeRO-3), and
adapters_off the policy itself with its LoRA adapters switched off (`mm_parallel.lora`).

Each micro-batch then carries an `mm_parallel.preference.PairedBatch` whose divisors make the
step's loss the mean over the global batch's N pairs whatever the layout (as mm_train.loss_share
does for tokens): micro-batch m of data-parallel rank r divides its pairs' summed loss by

    D_r = N / (n_r dp)          (and RPO's NLL by the chosen answers' tokens T / (n_r dp))

N and T: one all-reduce over dp per step. The metrics (TRL's names, each the global batch's mean
over its pairs): rewards/chosen = beta (log pi(y_w) - log pi_ref(y_w)), rewards/rejected,
rewards/margins (their difference), rewards/accuracies (the share of pairs whose chosen reward is
the larger), logps/chosen, logps/rejected and the reference's logps/ref_chosen, logps/ref_rejected:
summed on the last stage, all-reduced over pp and dp, read with the step's other figures
(mm_train.step_rows).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, List

import mindspore as ms
import numpy as np
from mindspore import ops

from mm_parallel import comm, lora, pipeline
from mm_parallel.preference import LogProbsOnly, PairedBatch
from mm_train.samples import inference
from mm_train.step_rows import PREFERENCE_FIELDS

ANSWER_TOKENS = "answer_tokens"  # mm_data.vl.pairs: each sequence's trained tokens, dropped before the forward


class PreferenceStep:
    """See the module docstring. ``build_reference()``: the frozen reference's chunks (dpo.reference copy)."""

    def __init__(self, recipe, chunks: List, topo, build_reference: Callable[[], List]):
        self.settings, self.topo, self.policy = recipe.dpo.settings(), topo, chunks
        self.mode = recipe.dpo.reference
        self.reference = None
        if self.mode == "copy":
            self.reference = build_reference()
            for chunk in self.reference:
                for parameter in chunk.get_parameters():
                    parameter.requires_grad = False
        self.batches: List[PairedBatch] = []

    def attach(self, batches: List[Dict], whole_batch: bool = True) -> List[Dict]:
        """``batches`` (forward keywords with `ANSWER_TOKENS`) with ``preference``: their pairs,
        the reference's log-probs, the divisors — the global batch's (`D_r`) or, with
        ``whole_batch`` false (validation), each micro-batch's own pairs."""
        answers = [np.asarray(b[ANSWER_TOKENS]) for b in batches]
        inputs = [{k: v for k, v in b.items() if k != ANSWER_TOKENS} for b in batches]
        pairs = [len(a) // 2 for a in answers]
        chosen_tokens = [int(a[:p].sum()) for a, p in zip(answers, pairs)]
        if whole_batch:
            totals = np.array([sum(pairs), sum(chosen_tokens)], np.float64)
            if self.topo.dp.size > 1:
                totals = comm.all_reduce(ms.Tensor(totals.astype(np.float32)), self.topo.dp).asnumpy()
            share = len(batches) * self.topo.dp.size
            divisors = [(float(totals[0]) / share, float(totals[1]) / share)] * len(batches)
        else:
            divisors = [(float(p), float(t)) for p, t in zip(pairs, chosen_tokens)]
        references = self.reference_log_probs(inputs, pairs)
        self.batches = []
        for batch, answer, p, reference, (per_pairs, per_tokens) in zip(inputs, answers, pairs, references, divisors):
            paired = PairedBatch(chosen=np.arange(p), rejected=np.arange(p, 2 * p), reference_chosen=reference[:p],
                                 reference_rejected=reference[p:], chosen_tokens=answer[:p],
                                 rejected_tokens=answer[p:], pairs_in_batch=per_pairs,
                                 chosen_tokens_in_batch=per_tokens, settings=self.settings)
            self.batches.append(paired)
            batch["preference"] = paired
        return inputs

    def reference_log_probs(self, batches: List[Dict], pairs: List[int]) -> List[np.ndarray]:
        """Each micro-batch's (2P,) reference log-probs (``pairs``: its P) on the last pipeline
        stage (zeros on the others, which never read them)."""
        chunks = self.reference or self.policy
        switched_off = lora.adapters_disabled(chunks) if self.mode == "adapters_off" else contextlib.nullcontext()
        recorders = [LogProbsOnly() for _ in batches]
        inputs = [{**b, "preference": r} for b, r in zip(batches, recorders)]
        with inference(chunks), switched_off:
            if self.topo.pp.size > 1:
                last = chunks[-1]
                pipeline.forward_only([c.pipeline_stage for c in chunks], [(b, b) for b in inputs],
                                      lambda y, b: last.pipeline_loss(y, b), self.topo, with_batch=True)
            else:
                for batch in inputs:
                    chunks[0](**batch)
        return [r.values.asnumpy() if r.values is not None else np.zeros(2 * p, np.float32)
                for r, p in zip(recorders, pairs)]

    def figures(self) -> Dict:
        """The step's metrics (module docstring): (1,) tensors, equal on every rank."""
        sums = ms.Tensor(np.zeros(len(PREFERENCE_FIELDS) + 1, np.float32))
        beta = self.settings.beta
        for paired in self.batches:
            if "chosen" not in paired.observed:  # a stage before the last: no loss computed here
                continue
            chosen, rejected = paired.observed["chosen"], paired.observed["rejected"]
            ref_chosen, ref_rejected = ms.Tensor(paired.reference_chosen), ms.Tensor(paired.reference_rejected)
            reward_chosen, reward_rejected = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
            values = [reward_chosen, reward_rejected, reward_chosen - reward_rejected,
                      (reward_chosen > reward_rejected).astype(ms.float32), chosen, rejected, ref_chosen, ref_rejected,
                      ops.ones_like(chosen)]
            sums = sums + ops.stack([v.astype(ms.float32).sum() for v in values])
        if self.topo.pp.size > 1:
            sums = comm.all_reduce(sums, self.topo.pp)
        if self.topo.dp.size > 1:
            sums = comm.all_reduce(sums, self.topo.dp)
        means = sums[:-1] / ops.maximum(sums[-1:], 1.0)
        return {name: means[i:i + 1] for i, name in enumerate(PREFERENCE_FIELDS)}
