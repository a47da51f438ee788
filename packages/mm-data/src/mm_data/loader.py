"""Batches from a data set: worker processes, prefetch, collation with padding, bad-sample substitution.

`DataLoader` walks a `BucketBatchSampler`'s global batches from a saved position and yields this
rank's share of each, collated. With ``num_workers > 0`` each batch is one task for a worker
process (started with ``spawn``: safe beside a training framework's threads); up to
``num_workers * prefetch`` batches are in flight and they are yielded in order, so the stream is
the same for any worker count. A sample that raises `BadSample` is recorded in the data set's
`BadInputLog` and replaced by another of the same bucket (`BucketBatchSampler.substitute`), so a
batch keeps its size and shape. A worker that dies or a batch that takes longer than ``timeout``
seconds raises an error naming it: the loader never hangs.

``state_dict()`` is the position after the last batch handed out; `load_state_dict` continues
from there exactly, under any data-parallel size.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
import traceback
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from mm_data.errors import BadInputLog, BadSample, DataError
from mm_data.sampler import BucketBatchSampler


class Collator:
    """Stack each field over the batch, padding ragged arrays at the end of every axis.

    Padding values by field name (``labels`` pads with -100, the ignored label; everything else 0
    unless ``pad_values`` says otherwise); strings are gathered into lists. Fields named in
    ``concatenate`` (image patches and grids: each sample has its own number) are joined along
    the first axis over the samples that have them. ``pad_to_multiple_of`` pads the last axis of
    the ``sequence_fields`` further, to a multiple (context / sequence parallelism cut sequences
    into equal parts).
    """

    def __init__(self, pad_values: Optional[Dict[str, float]] = None, concatenate: Sequence[str] = (),
                 pad_to_multiple_of: int = 1,
                 sequence_fields: Sequence[str] = ("input_ids", "labels", "attention_mask", "mm_token_type_ids")):
        self.pad_values = {"labels": -100, **(pad_values or {})}
        self.concatenate, self.multiple, self.sequence_fields = tuple(concatenate), pad_to_multiple_of, sequence_fields

    def __call__(self, samples: List[dict]) -> dict:
        batch = {}
        keys = list(dict.fromkeys(key for sample in samples for key in sample))
        for key in keys:
            if key in self.concatenate:
                batch[key] = np.concatenate([np.asarray(sample[key]) for sample in samples if key in sample])
                continue
            if any(key not in sample for sample in samples):
                raise ValueError(f"field {key!r} is missing from some samples of the batch; name it in "
                                 f"Collator(concatenate=...) if samples may lack it")
            values = [sample[key] for sample in samples]
            if isinstance(values[0], str):
                batch[key] = values
                continue
            arrays = [np.asarray(value) for value in values]
            shape = tuple(max(sizes) for sizes in zip(*(a.shape for a in arrays)))
            if key in self.sequence_fields and shape and self.multiple > 1:
                shape = shape[:-1] + (-(-shape[-1] // self.multiple) * self.multiple,)
            if any(a.shape != shape for a in arrays):
                fill = self.pad_values.get(key, 0)
                arrays = [np.pad(a, [(0, s - n) for s, n in zip(shape, a.shape)], constant_values=fill) for a in arrays]
            batch[key] = np.stack(arrays)
        return batch


def _fetch(dataset, index: int, epoch: int):
    return dataset.get(index, epoch) if hasattr(dataset, "get") else dataset[index]


def build_batch(dataset, sampler: BucketBatchSampler, collate, epoch: int, indices, max_substitutes: int):
    """Collated samples ``indices`` of ``epoch`` and the (source, reason) of each bad sample met."""
    samples, bad = [], []
    for index in indices:
        candidate = int(index)
        for attempt in range(max_substitutes + 1):
            try:
                samples.append(_fetch(dataset, candidate, epoch))
                break
            except BadSample as error:
                bad.append((error.source, error.reason))
                candidate = sampler.substitute(int(index), epoch, attempt)
        else:
            raise DataError(f"sample {index} and {max_substitutes} substitutes from its bucket are all bad: "
                            + "; ".join(f"{s}: {r}" for s, r in bad[-max_substitutes - 1:]))
    return collate(samples), bad


def _worker_loop(dataset, sampler, collate, max_substitutes, tasks, results):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    while True:
        task = tasks.get()
        if task is None:
            return
        task_id, epoch, indices = task
        try:
            batch, bad = build_batch(dataset, sampler, collate, epoch, indices, max_substitutes)
            results.put((task_id, batch, bad, None))
        except Exception as error:  # sent to the main process, which raises it with the worker's traceback
            results.put((task_id, None, [], f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


class DataLoader:
    """See the module docstring."""

    def __init__(self, dataset, sampler: BucketBatchSampler, collate=None, num_workers: int = 0, prefetch: int = 2,
                 timeout: float = 300.0, max_substitutes: int = 3, start_method: str = "spawn"):
        if num_workers < 0 or prefetch < 1:
            raise ValueError(f"num_workers must be >= 0 and prefetch >= 1, got {num_workers}, {prefetch}")
        self.dataset, self.sampler, self.collate = dataset, sampler, collate or Collator()
        self.num_workers, self.prefetch, self.timeout = num_workers, prefetch, timeout
        self.max_substitutes, self.start_method = max_substitutes, start_method
        self.bad_input: BadInputLog = getattr(dataset, "bad_input", None) or BadInputLog()
        self.epoch, self.position = 0, 0
        self._workers: List = []

    # ---- position -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.sampler.seed,
                "global_batch_size": self.sampler.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "global_batch_size"):
            if key in state and state[key] != getattr(self.sampler, key):
                raise ValueError(f"the saved data position was made with {key}={state[key]}, this sampler has "
                                 f"{getattr(self.sampler, key)}: resuming would not continue the same stream")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    # ---- iteration ------------------------------------------------------------------------
    def _record(self, bad: List[Tuple[str, str]]) -> None:
        for source, reason in bad:
            self.bad_input.skip(BadSample(source, reason))

    def __iter__(self):
        positions = self.sampler.positions(self.epoch, self.position)
        if self.num_workers == 0:
            for epoch, position, batch in positions:
                collated, bad = build_batch(self.dataset, self.sampler, self.collate, epoch, self.sampler.local(batch),
                                            self.max_substitutes)
                self._record(bad)
                self.epoch, self.position = self._after(epoch, position)
                yield collated
        else:
            yield from self._iterate_with_workers(positions)

    def _after(self, epoch: int, position: int) -> Tuple[int, int]:
        if position + 1 < len(self.sampler.epoch_batches(epoch)):
            return epoch, position + 1
        return epoch + 1, 0

    def _iterate_with_workers(self, positions):
        context = multiprocessing.get_context(self.start_method)
        results = context.Queue()
        tasks = [context.Queue() for _ in range(self.num_workers)]
        self._workers = [context.Process(target=_worker_loop, daemon=True, name=f"mm-data-worker-{w}",
                                         args=(self.dataset, self.sampler, self.collate, self.max_substitutes,
                                               tasks[w], results)) for w in range(self.num_workers)]
        for worker in self._workers:
            worker.start()
        in_flight, done, next_task, next_yield = {}, {}, 0, 0
        try:
            while True:
                while len(in_flight) < self.num_workers * self.prefetch:
                    epoch, position, batch = next(positions)
                    tasks[next_task % self.num_workers].put((next_task, epoch, self.sampler.local(batch).tolist()))
                    in_flight[next_task] = (epoch, position)
                    next_task += 1
                while next_yield not in done:
                    task_id, batch, bad, error = self._receive(results, next_yield)
                    done[task_id] = (batch, bad, error)
                batch, bad, error = done.pop(next_yield)
                if error is not None:
                    raise DataError(f"data worker failed on batch {in_flight[next_yield]}:\n{error}")
                self._record(bad)
                self.epoch, self.position = self._after(*in_flight.pop(next_yield))
                next_yield += 1
                yield batch
        finally:
            self.close(tasks)

    def _receive(self, results, task_id: int):
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return results.get(timeout=1.0)
            except queue.Empty:
                pass
            for number, worker in enumerate(self._workers):
                if not worker.is_alive():
                    raise DataError(f"data worker {number} (pid {worker.pid}) died with exit code {worker.exitcode} "
                                    f"while batch {task_id} was pending")
            if time.monotonic() > deadline:
                raise DataError(f"batch {task_id} took more than timeout={self.timeout} s in the data workers; "
                                f"raise the timeout or look for a stuck decode")

    def close(self, tasks=None) -> None:
        """Stop the worker processes (also done when iteration ends or fails)."""
        for task_queue in tasks or []:
            try:
                task_queue.put(None)
            except (ValueError, OSError):
                pass
        for worker in self._workers:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.terminate()
                worker.join(timeout=5)
        self._workers = []
