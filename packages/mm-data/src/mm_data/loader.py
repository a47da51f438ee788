"""Batches from a data set: worker processes, prefetch, collation with padding, bad-sample substitution.

`DataLoader` walks a `BucketBatchSampler`'s global batches from a saved position and yields this
rank's share of each, collated. With ``num_workers > 0`` each batch is one task for a worker
process (forked, so it inherits the data set; it runs only data code, never the training
framework); tasks go out as JSON and batches come back as safetensors bytes over pipes — nothing
is pickled. Up to
``num_workers * prefetch`` batches are in flight and they are yielded in order, so the stream is
the same for any worker count. A sample that raises `BadSample` is recorded in the data set's
`BadInputLog` and replaced by another of the same bucket (`BucketBatchSampler.substitute`), so a
batch keeps its size and shape. A worker that dies or a batch that takes longer than ``timeout``
seconds raises an error naming it: the loader never hangs.

``state_dict()`` is the position after the last batch handed out; `load_state_dict` continues
from there exactly, under any data-parallel size.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
import traceback
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from mm_data.errors import BadInputLog, BadSample, DataError
from mm_data.sampler import BucketBatchSampler


def concatenate_padded(parts, fill=0) -> np.ndarray:
    """``parts`` joined along the first axis, their other axes padded with ``fill`` to the longest
    (image patches and grids; audio features, each audio its own number of frames)."""
    parts = [np.asarray(a) for a in parts]
    widest = tuple(max(sizes) for sizes in zip(*(a.shape[1:] for a in parts)))
    return np.concatenate([np.pad(a, [(0, 0)] + [(0, w - n) for w, n in zip(widest, a.shape[1:])],
                                  constant_values=fill) for a in parts])


class Collator:
    """Stack each field over the batch, padding ragged arrays at the end of every axis.

    Padding values by field name (``labels`` pads with -100, the ignored label; everything else 0
    unless ``pad_values`` says otherwise); strings are gathered into lists. Fields named in
    ``concatenate`` (image patches and grids: each sample has its own number) are joined along
    the first axis over the samples that have them, their other axes padded to the longest (audio
    features: each audio its own number of frames). ``pad_to_multiple_of`` pads the last axis of
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
            if key in self.concatenate:  # other axes padded to the longest (audio features: frames)
                batch[key] = concatenate_padded([sample[key] for sample in samples if key in sample],
                                                self.pad_values.get(key, 0))
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
        candidate, tried = int(index), []  # a substitute is never one already found bad for this index
        for attempt in range(max_substitutes + 1):
            try:
                samples.append(_fetch(dataset, candidate, epoch))
                break
            except BadSample as error:
                bad.append((error.source, error.reason))
                tried.append(candidate)
                candidate = sampler.substitute(int(index), epoch, attempt, exclude=tried)
                if candidate is None:
                    raise DataError(f"sample {index} and every other sample of its bucket ({len(tried)} in all) are "
                                    "bad: " + "; ".join(f"{s}: {r}" for s, r in bad[-len(tried):])) from None
        else:
            raise DataError(f"sample {index} and {max_substitutes} substitutes from its bucket are all bad: "
                            + "; ".join(f"{s}: {r}" for s, r in bad[-max_substitutes - 1:]))
    return collate(samples), bad


def encode(value) -> bytes:
    """A batch (dicts / lists of numpy arrays, strings and numbers) as bytes: a JSON skeleton and
    the arrays in one safetensors blob. Workers hand batches over this way — no pickle."""
    from safetensors.numpy import save

    arrays = {}

    def skeleton(item):
        if isinstance(item, (np.ndarray, np.generic)):
            name = f"t{len(arrays)}"
            arrays[name] = np.ascontiguousarray(item)
            return {"array": name, "scalar": isinstance(item, np.generic)}
        if isinstance(item, dict):
            return {"dict": {str(k): skeleton(v) for k, v in item.items()}}
        if isinstance(item, (list, tuple)):
            return {"list": [skeleton(v) for v in item]}
        return {"json": item}

    header = json.dumps(skeleton(value)).encode()
    return len(header).to_bytes(8, "little") + header + (save(arrays) if arrays else b"")


def decode(data: bytes):
    """The inverse of `encode`."""
    from safetensors.numpy import load

    size = int.from_bytes(data[:8], "little")
    header, blob = json.loads(data[8:8 + size]), data[8 + size:]
    arrays = load(blob) if blob else {}

    def build(node):
        if "array" in node:
            array = arrays[node["array"]]
            return array[()] if node["scalar"] else array
        if "dict" in node:
            return {k: build(v) for k, v in node["dict"].items()}
        if "list" in node:
            return [build(v) for v in node["list"]]
        return node["json"]

    return build(header)


def _worker_loop(dataset, sampler, collate, max_substitutes, tasks, results):
    """A worker process (forked: it inherits the data set). Tasks and results are bytes over pipes."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    while True:
        message = tasks.recv_bytes()
        if not message:
            return
        task_id, epoch, indices = json.loads(message)
        try:
            batch, bad = build_batch(dataset, sampler, collate, epoch, indices, max_substitutes)
            reply = {"task": task_id, "batch": batch, "bad": [list(b) for b in bad], "error": None}
        except Exception as error:  # sent to the main process, which raises it with the worker's traceback
            reply = {"task": task_id, "batch": None, "bad": [], "error": f"{type(error).__name__}: {error}\n"
                                                                          f"{traceback.format_exc()}"}
        results.send_bytes(encode(reply))


class DataLoader:
    """See the module docstring."""

    def __init__(self, dataset, sampler: BucketBatchSampler, collate=None, num_workers: int = 0, prefetch: int = 2,
                 timeout: float = 300.0, max_substitutes: int = 3, start_method: str = "fork"):
        if num_workers < 0 or prefetch < 1:
            raise ValueError(f"num_workers must be >= 0 and prefetch >= 1, got {num_workers}, {prefetch}")
        self.dataset, self.sampler, self.collate = dataset, sampler, collate or Collator()
        self.num_workers, self.prefetch, self.timeout = num_workers, prefetch, timeout
        self.max_substitutes, self.start_method = max_substitutes, start_method
        self.bad_input: BadInputLog = getattr(dataset, "bad_input", None) or BadInputLog()
        self.epoch, self.position = 0, 0
        self._workers: List = []
        self._tasks: List = []
        self._results: List = []

    # ---- position -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return self.sampler.state(self.epoch, self.position)

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "global_batch_size", "global_batch_tokens"):
            # a position without global_batch_tokens counted samples (the sampler writes it only when set)
            current = getattr(self.sampler, key, None)
            saved = state.get(key) if key == "global_batch_tokens" else state.get(key, current)
            if saved != current:
                raise ValueError(f"the saved data position was made with {key}={saved}, this sampler has "
                                 f"{current}: resuming would not continue the same stream")
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
        pipes = [(context.Pipe(duplex=False), context.Pipe(duplex=False)) for _ in range(self.num_workers)]
        self._tasks = [task_send for (_, task_send), _ in pipes]
        self._results = [result_recv for _, (result_recv, _) in pipes]
        self._workers = [context.Process(target=_worker_loop, daemon=True, name=f"mm-data-worker-{w}",
                                         args=(self.dataset, self.sampler, self.collate, self.max_substitutes,
                                               task_recv, result_send))
                         for w, ((task_recv, _), (_, result_send)) in enumerate(pipes)]
        for worker in self._workers:
            worker.start()
        for (task_recv, _), (_, result_send) in pipes:  # the workers hold these ends now
            task_recv.close()
            result_send.close()
        in_flight, done, next_task, next_yield = {}, {}, 0, 0
        try:
            while True:
                while len(in_flight) < self.num_workers * self.prefetch:
                    epoch, position, batch = next(positions)
                    task = [next_task, epoch, self.sampler.local(batch).tolist()]
                    self._tasks[next_task % self.num_workers].send_bytes(json.dumps(task).encode())
                    in_flight[next_task] = (epoch, position)
                    next_task += 1
                while next_yield not in done:
                    for reply in self._receive(next_yield):
                        done[reply["task"]] = reply
                reply = done.pop(next_yield)
                if reply["error"] is not None:
                    raise DataError(f"data worker failed on batch {in_flight[next_yield]}:\n{reply['error']}")
                self._record([tuple(b) for b in reply["bad"]])
                self.epoch, self.position = self._after(*in_flight.pop(next_yield))
                next_yield += 1
                yield reply["batch"]
        finally:
            self.close()

    def _receive(self, task_id: int):
        """The replies that arrive next (waiting at most ``timeout``); a dead worker is an error."""
        from multiprocessing.connection import wait

        deadline = time.monotonic() + self.timeout
        while True:
            ready = wait(self._results, timeout=1.0)
            replies = []
            for connection in ready:
                try:
                    replies.append(decode(connection.recv_bytes()))
                except EOFError:
                    pass  # its worker exited: reported below
            if replies:
                return replies
            for number, worker in enumerate(self._workers):
                if not worker.is_alive():
                    raise DataError(f"data worker {number} (pid {worker.pid}) died with exit code {worker.exitcode} "
                                    f"while batch {task_id} was pending")
            if time.monotonic() > deadline:
                raise DataError(f"batch {task_id} took more than timeout={self.timeout} s in the data workers; "
                                f"raise the timeout or look for a stuck decode")

    def close(self) -> None:
        """Stop the worker processes (also done when iteration ends or fails)."""
        for connection in getattr(self, "_tasks", []):
            try:
                connection.send_bytes(b"")
            except (OSError, ValueError):
                pass
        for worker in self._workers:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.terminate()
                worker.join(timeout=5)
        for connection in getattr(self, "_tasks", []) + getattr(self, "_results", []):
            connection.close()
        self._workers, self._tasks, self._results = [], [], []
