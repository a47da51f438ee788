"""train.objective dpo in the training loop: the frozen reference, each micro-batch's pairs, the metrics.

A micro-batch of P pairs holds 2P rows or sequences, the P chosen ones first: the VL families'
answers (mm_data.vl.pairs: padded rows or one packed row, a pair's media through the towers once;
`ANSWER_TOKENS` marks them) or the video families' clips (one noise draw per pair; `CLIP_PAIRS`).
Before the policy's forward the reference gives what the loss compares — each sequence's
log-probability, each clip's denoising error — through `mm_parallel.preference.ReferencePass` as
the forward's ``preference`` (the policy's own forward and pipeline code, forward only; the last
pipeline stage keeps them): ``dpo.reference`` copy is a second, frozen model built from the
starting weights (the model folder or the seed's draw, sharded like the policy: tp, pp, ZeRO-3),
adapters_off the policy itself with its LoRA adapters switched off (`mm_parallel.lora`).

Each micro-batch then carries the objective (`mm_parallel.preference.PairedBatch`: DPO / IPO /
hinge on log-probs; `DiffusionPairs`: Diffusion-DPO on errors) whose divisor makes the step's loss
the mean over the global batch's N pairs whatever the layout (as mm_train.loss_share does for
tokens): micro-batch m of data-parallel rank r divides its pairs' summed loss by

    D_r = N / (n_r dp)          (and RPO's NLL by the chosen answers' tokens T / (n_r dp))

N and T: one all-reduce over dp per step. The metrics, each the global batch's mean over its pairs
(TRL's names): rewards/chosen and rewards/rejected — beta (log pi - log pi_ref) of each answer,
or for clips the implicit reward -beta (e - e_ref) — rewards/margins (their difference),
rewards/accuracies (the share of pairs whose chosen reward is the larger), and the policy's and
the reference's values (logps/chosen, logps/rejected, logps/ref_chosen, logps/ref_rejected; for
clips errors/...): summed on the last stage, all-reduced over pp and dp, read with the step's other
figures (mm_train.step_rows).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, List

import mindspore as ms
import numpy as np
from mindspore import ops

from mm_parallel import comm, lora, pipeline
from mm_parallel.preference import DIFFUSION_BETA, DiffusionPairs, PairedBatch, ReferencePass
from mm_train.samples import inference

ANSWER_TOKENS = "answer_tokens"  # mm_data.vl.pairs: each sequence's trained tokens
CLIP_PAIRS = "clip_pairs"  # mm_train.families.video.data: the micro-batch's clip pairs
PAIR_KEYS = (ANSWER_TOKENS, CLIP_PAIRS)  # dropped before the forward


def pairs_of(batch: Dict) -> int:
    """The pairs a micro-batch holds."""
    return len(batch[ANSWER_TOKENS]) // 2 if ANSWER_TOKENS in batch else int(batch[CLIP_PAIRS])


class PreferenceStep:
    """See the module docstring. ``build_reference()``: the frozen reference's chunks (dpo.reference copy)."""

    def __init__(self, recipe, chunks: List, topo, build_reference: Callable[[], List]):
        self.dpo, self.topo, self.policy = recipe.dpo, topo, chunks
        self.settings = recipe.dpo.settings()
        self.reference = None
        if self.dpo.reference == "copy":
            self.reference = build_reference()
            for chunk in self.reference:
                for parameter in chunk.get_parameters():
                    parameter.requires_grad = False
        self.batches: List = []

    def attach(self, batches: List[Dict], whole_batch: bool = True) -> List[Dict]:
        """``batches`` (forward keywords with their `PAIR_KEYS`) with ``preference``: their pairs,
        the reference's values, the divisors — the global batch's (`D_r`) or, with ``whole_batch``
        false (validation), each micro-batch's own pairs."""
        pairs = [pairs_of(b) for b in batches]
        answers = [np.asarray(b[ANSWER_TOKENS]) if ANSWER_TOKENS in b else None for b in batches]
        chosen_tokens = [int(a[:p].sum()) if a is not None else 0 for a, p in zip(answers, pairs)]
        inputs = [{k: v for k, v in b.items() if k not in PAIR_KEYS} for b in batches]
        if whole_batch:
            totals = np.array([sum(pairs), sum(chosen_tokens)], np.float32)
            if self.topo.dp.size > 1:
                totals = comm.all_reduce(ms.Tensor(totals), self.topo.dp).asnumpy()
            share = len(batches) * self.topo.dp.size
            divisors = [(float(totals[0]) / share, float(totals[1]) / share)] * len(batches)
        else:
            divisors = [(float(p), float(t)) for p, t in zip(pairs, chosen_tokens)]
        references = self.reference_values(inputs, pairs)
        self.batches = []
        for batch, answer, p, reference, divisor in zip(inputs, answers, pairs, references, divisors):
            batch["preference"] = self._objective(p, answer, reference, divisor)
            self.batches.append(batch["preference"])
        return inputs

    def _objective(self, p: int, answer, reference: np.ndarray, divisor):
        """A micro-batch's PairedBatch (sequences) or DiffusionPairs (clips)."""
        chosen, rejected = np.arange(p), np.arange(p, 2 * p)
        if answer is None:
            return DiffusionPairs(chosen, rejected, reference[:p], reference[p:], divisor[0],
                                  beta=self.dpo.beta if self.dpo.beta is not None else DIFFUSION_BETA)
        return PairedBatch(chosen, rejected, reference[:p], reference[p:], answer[:p], answer[p:], divisor[0],
                           divisor[1], settings=self.settings)

    def reference_values(self, batches: List[Dict], pairs: List[int]) -> List[np.ndarray]:
        """Each micro-batch's (2P,) reference values (``pairs``: its P) on the last pipeline stage
        (zeros on the others, which never read them)."""
        chunks = self.reference or self.policy
        off = lora.adapters_disabled(chunks) if self.dpo.reference == "adapters_off" else contextlib.nullcontext()
        recorders = [ReferencePass() for _ in batches]
        inputs = [{**b, "preference": r} for b, r in zip(batches, recorders)]
        with inference(chunks), off:
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
        clips = bool(self.batches) and isinstance(self.batches[0], DiffusionPairs)
        values = "errors" if clips else "logps"
        names = ["rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", f"{values}/chosen",
                 f"{values}/rejected", f"{values}/ref_chosen", f"{values}/ref_rejected"]
        sums = ms.Tensor(np.zeros(len(names) + 1, np.float32))
        for paired in self.batches:
            if "chosen" not in paired.observed:  # a stage before the last: no loss computed here
                continue
            chosen, rejected = paired.observed["chosen"], paired.observed["rejected"]
            ref_chosen, ref_rejected = ms.Tensor(paired.reference_chosen), ms.Tensor(paired.reference_rejected)
            beta = -paired.beta if clips else self.settings.beta  # clips: a lower error is the reward
            reward_chosen, reward_rejected = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
            terms = [reward_chosen, reward_rejected, reward_chosen - reward_rejected,
                     (reward_chosen > reward_rejected).astype(ms.float32), chosen, rejected, ref_chosen, ref_rejected,
                     ops.ones_like(chosen)]
            sums = sums + ops.stack([t.astype(ms.float32).sum() for t in terms])
        if self.topo.pp.size > 1:
            sums = comm.all_reduce(sums, self.topo.pp)
        if self.topo.dp.size > 1:
            sums = comm.all_reduce(sums, self.topo.dp)
        means = sums[:-1] / ops.maximum(sums[-1:], 1.0)
        return {name: means[i:i + 1] for i, name in enumerate(names)}
