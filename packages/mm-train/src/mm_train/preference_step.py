"""train.objective dpo in the training loop: the frozen reference, each micro-batch's pairs, the metrics.

A micro-batch of P pairs holds 2P rows or sequences, the P chosen ones first: the VL families'
answers (mm_data.vl.pairs: padded rows or one packed row, a pair's media through the towers once;
`ANSWER_TOKENS` marks them) or the video families' clips (one noise draw per pair; `CLIP_PAIRS`).
Before the policy's forward the reference gives what the loss compares — each sequence's
log-probability, each clip's denoising error — through `mm_parallel.preference.ReferencePass` as
the forward's ``preference`` (the policy's own forward and pipeline code, forward only; the last
pipeline stage keeps them): ``dpo.reference`` copy is a second, frozen model built from the
starting weights (the model folder or the seed's draw, sharded like the policy: tp, pp, ZeRO-3),
adapters_off the policy itself with its LoRA adapters switched off (`mm_parallel.lora`), and
cached (answers only: a clip's noise changes every step) the starting policy's values of every
pair of the data set, computed before step 1 (`PreferenceStep.start`: each data-parallel rank its
share in micro-batches of padded rows, gathered) into OUT/reference_logps.safetensors, which a
resumed run reads back — no second model, no reference forward in the steps.

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

import math
import os
from typing import Callable, Dict, List

import mindspore as ms
import numpy as np
from mindspore import ops

from mm_parallel import comm
from mm_parallel.preference import DIFFUSION_BETA, DiffusionPairs, PairedBatch, ReferencePass
from mm_train.evaluation import recorded

# Deferred imports: mm-data, safetensors (optional: a missing one is named when a run needs it).

REFERENCE_CACHE = "reference_logps.safetensors"  # dpo.reference cached: every pair's reference log-probs
PAIR_INDEX = "pair_index"  # mm_data.vl.pairs: each pair's index in the data set
ANSWER_TOKENS = "answer_tokens"  # mm_data.vl.pairs: each sequence's trained tokens
CLIP_PAIRS = "clip_pairs"  # mm_train.families.video.data: the micro-batch's clip pairs
PAIR_KEYS = (ANSWER_TOKENS, CLIP_PAIRS, PAIR_INDEX)  # dropped before the forward


def pairs_of(batch: Dict) -> int:
    """The pairs a micro-batch holds."""
    return len(batch[ANSWER_TOKENS]) // 2 if ANSWER_TOKENS in batch else int(batch[CLIP_PAIRS])


class PreferenceStep:
    """See the module docstring. ``build_reference()``: the frozen reference's chunks (dpo.reference copy:
    the starting weights, no parameter trained)."""

    def __init__(self, recipe, chunks: List, topo, build_reference: Callable[[], List]):
        self.dpo, self.topo, self.policy = recipe.dpo, topo, chunks
        self.settings, self.recipe = recipe.dpo.settings(), recipe
        self.reference, self.table = None, None  # the copy's chunks; cached: {pair index: (chosen, rejected)}
        if self.dpo.reference == "copy":
            self.reference = build_reference()
        self.batches: List = []

    @staticmethod
    def step_batches(stream, step: int) -> List[Dict]:
        """The step's micro-batches: the stream's next (a step's pairs)."""
        return next(stream)

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
        if self.table is not None:
            references = [self._cached(b[PAIR_INDEX]) for b in batches]
        else:
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
        recorders = recorded(self.reference or self.policy, batches, [ReferencePass() for _ in batches], self.topo,
                             self.dpo.reference == "adapters_off")
        return [r.values.asnumpy() if r.values is not None else np.zeros(2 * p, np.float32)
                for r, p in zip(recorders, pairs)]

    def start(self, task, out: str, first: int, writer: bool) -> None:
        """dpo.reference cached (module docstring): compute the table before step 1 (``writer``: this
        rank writes the file, one per disk), or read it back when resuming at step ``first``."""
        if self.dpo.reference != "cached":
            return
        from safetensors.numpy import load_file, save_file

        path = os.path.join(out, REFERENCE_CACHE)
        if first:
            if not os.path.isfile(path):
                raise ValueError(f"resuming a dpo.reference cached run needs {path}, written before its step 1 from "
                                 "the starting weights, and it is not there: start the run again (--overwrite)")
            saved = load_file(path)
            self.table = dict(zip(saved["index"].tolist(), zip(saved["chosen"].tolist(), saved["rejected"].tolist())))
            return
        self.table = self._compute(task)
        if writer:
            index = np.array(sorted(self.table), np.int64)
            values = np.array([self.table[i] for i in index.tolist()], np.float32).reshape(-1, 2)
            os.makedirs(out, exist_ok=True)
            save_file({"index": index, "chosen": values[:, 0].copy(), "rejected": values[:, 1].copy()}, path + ".tmp")
            os.replace(path + ".tmp", path)
        comm.barrier(self.topo.world)

    def _compute(self, task) -> Dict:
        """{pair index: (chosen, rejected)} of every pair of ``task``'s data set, each data-parallel
        rank its share in micro-batches of padded rows (as many on every rank: ZeRO-3 gathers over
        dp), the last stage's values gathered from every rank."""
        from mm_data import BadSample

        topo, size = self.topo, self.recipe.train.micro_batch_size
        mine = list(range(topo.dp.rank, len(task.dataset), topo.dp.size))
        batches = []
        for start in range(0, len(mine), size):
            samples = []
            for index in mine[start:start + size]:
                try:
                    samples.append(task.dataset.get(index))
                except BadSample:  # never trained on either: the loader substitutes it
                    continue
            if samples:
                batches.append(task.model_inputs(task.collate(samples)))
        if not batches:
            raise ValueError(f"data-parallel rank {topo.dp.rank} found no readable pair for the reference cache")
        count = math.ceil(math.ceil(len(task.dataset) / topo.dp.size) / size)
        batches += [batches[-1]] * (count - len(batches))
        rows = []
        for batch in batches:
            pairs = pairs_of(batch)
            values = self.reference_values([{k: v for k, v in batch.items() if k not in PAIR_KEYS}], [pairs])[0]
            rows += [(int(i), values[p], values[pairs + p]) for p, i in enumerate(batch[PAIR_INDEX])]
        keeps = topo.pp.rank == topo.pp.size - 1 and topo.tp.rank == 0 and topo.cp.rank == 0
        mine = np.array(rows, np.float64).tobytes() if keeps else b""
        table = {}
        for part in comm.all_gather_bytes(mine, topo.world):
            for index, chosen, rejected in np.frombuffer(part, np.float64).reshape(-1, 3):
                table[int(index)] = (float(chosen), float(rejected))
        return table

    def _cached(self, indices) -> np.ndarray:
        """(2P,) reference values of the pairs ``indices`` from the cache: chosen, then rejected."""
        missing = [int(i) for i in indices if int(i) not in self.table]
        if missing:
            raise ValueError(f"pairs {missing[:5]} have no cached reference value; the data changed since "
                             f"{REFERENCE_CACHE} was written: start the run again (--overwrite)")
        values = [self.table[int(i)] for i in indices]
        return np.array([c for c, _ in values] + [r for _, r in values], np.float32)

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
