"""Encode a data set once, train on the stored features: latents and text embeddings on disk.

`build_feature_cache` runs the encoders it is given (a VAE, a text encoder — any callables from
a batch to a batch-first numpy array, so mm-data stays framework-free) over a data set, evaluation
style (centre crops), and writes the features per sample into safetensors shards with a JSONL
index. Rank ``r`` of ``world_size`` encodes samples ``r, r + world_size, ...`` (of a sharded data
set the ``r``-th contiguous share, so it reads only its own blocks) and writes its own
shards and index, so ranks never touch one file (ranks that encode together — a context-parallel
VAE's group — pass their group's number as ``rank``, and only one of them writes). A shard is
written to a temporary name and renamed before its index lines are appended, so the index never
names a missing shard; a rerun skips the samples already indexed and finishes an interrupted
cache. Bad samples are skipped through the data set's `BadInputLog`.

On node-local disks the nodes' indexes are exchanged (`mm_data.feature_nodes`) and
`FeatureDataset` reads the folder back: ``get(i)`` gives the sample's feature arrays (plus its
caption), ``keys`` the shape of each sample's features for bucketed batching. `FeaturePairs`
serves a cache built from clip pairs (mm_data.video.pairs) one pair per sample.
"""

from __future__ import annotations

import glob
import json
import os
from collections import defaultdict
from typing import Callable, Dict, List, Mapping, Optional

import numpy as np

from mm_data.errors import BadInputLog, BadSample
from mm_data.feature_nodes import node_entries, rank_entries
from mm_data.video.pairs import PAIR_LIST

INDEX_PATTERN = "index-r{rank:03d}.jsonl"


def cached_indices(folder: str) -> set:
    """The samples a cache folder already holds (every rank's index)."""
    return {entry["index"] for entry in rank_entries(folder)}


def build_feature_cache(dataset, encoders: Mapping[str, Callable[[dict], np.ndarray]], folder: str,
                        batch_size: int = 1, samples_per_shard: int = 64, rank: int = 0, world_size: int = 1,
                        collate: Optional[Callable] = None, done: Optional[set] = None, write: bool = True) -> int:
    """Encode this rank's share of ``dataset`` into ``folder``; returns the number of samples
    encoded. ``done``: the samples to skip (default `cached_indices`; ranks encoding together
    must pass the same set, read before any of them writes); ``write`` False encodes without
    writing (a helper rank whose encoders take part in collectives)."""
    from safetensors.numpy import save_file

    from mm_data.loader import Collator

    collate = collate or Collator()
    os.makedirs(folder, exist_ok=True)
    bad_input = getattr(dataset, "bad_input", None) or BadInputLog()
    done = cached_indices(folder) if done is None else done
    if getattr(dataset, "shards", None) is not None:  # shards: a contiguous share, so a rank reads its blocks only
        mine = [i for i in range(rank * len(dataset) // world_size, (rank + 1) * len(dataset) // world_size)
                if i not in done]
    else:
        mine = [i for i in range(rank, len(dataset), world_size) if i not in done]
    keys = getattr(dataset, "keys", None)
    groups: Dict[object, List[int]] = defaultdict(list)  # equal shapes batch together
    for index in mine:
        groups[keys[index] if keys is not None else 0].append(index)
    shard_number = len(glob.glob(os.path.join(folder, f"features-r{rank:03d}-*.safetensors")))
    pending_tensors, pending_lines, written = {}, [], 0

    def flush():
        nonlocal shard_number, pending_tensors, pending_lines
        if not pending_lines or not write:
            pending_tensors, pending_lines = {}, []
            return
        name = f"features-r{rank:03d}-{shard_number:05d}.safetensors"
        save_file(pending_tensors, os.path.join(folder, name + ".tmp"))
        os.replace(os.path.join(folder, name + ".tmp"), os.path.join(folder, name))
        with open(os.path.join(folder, INDEX_PATTERN.format(rank=rank)), "a", encoding="utf-8") as f:
            for line in pending_lines:
                f.write(json.dumps({**line, "shard": name}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        shard_number, pending_tensors, pending_lines = shard_number + 1, {}, []

    for members in groups.values():
        for start in range(0, len(members), batch_size):
            samples, indices = [], []
            for index in members[start:start + batch_size]:
                try:
                    samples.append(dataset.get(index, 0) if hasattr(dataset, "get") else dataset[index])
                    indices.append(index)
                except BadSample as error:
                    bad_input.skip(error)
            if not samples:
                continue
            batch = collate(samples)
            features = {name: np.asarray(encode(batch)) for name, encode in encoders.items()}
            for row, index in enumerate(indices):
                for name, values in features.items():
                    pending_tensors[f"{index}/{name}"] = np.ascontiguousarray(values[row])
                line = {"index": index, "features": {n: list(v.shape[1:]) for n, v in features.items()}}
                if isinstance(samples[row].get("caption"), str):
                    line["caption"] = samples[row]["caption"]
                if hasattr(dataset, "source"):
                    line["source"] = dataset.source(index)
                pending_lines.append(line)
                written += 1
            if len(pending_lines) >= samples_per_shard:
                flush()
    flush()
    return written


class FeatureDataset:
    """The features `build_feature_cache` wrote, one sample per indexed data-set entry."""

    def __init__(self, folder: str):
        self.folder = folder
        local = {entry["index"]: entry for entry in rank_entries(folder)}  # a sample this node holds: its own entry
        remote = {entry["index"]: entry for entry in node_entries(folder) if entry["index"] not in local}
        self.entries = sorted([*local.values(), *remote.values()], key=lambda entry: entry["index"])
        if not self.entries:
            raise ValueError(f"{folder} holds no feature index (index-r*.jsonl); build it with build_feature_cache")
        self.keys = [tuple(tuple(shape) for shape in entry["features"].values()) for entry in self.entries]
        self.bad_input = BadInputLog(total=len(self.entries))
        self._open = {}

    def __len__(self) -> int:
        return len(self.entries)

    def source(self, index: int) -> str:
        return self.entries[index].get("source", f"sample {self.entries[index]['index']}")

    def get(self, index: int, epoch: int = 0) -> dict:
        from safetensors import safe_open

        entry = self.entries[index]
        shard = entry["shard"]
        if shard not in self._open:
            path = os.path.join(self.folder, shard)
            if not os.path.isfile(path):
                raise BadSample(path, "feature shard missing")
            self._open[shard] = safe_open(path, framework="np")
        sample = {name: self._open[shard].get_tensor(f"{entry['index']}/{name}") for name in entry["features"]}
        if "caption" in entry:
            sample["caption"] = entry["caption"]
        sample["index"] = np.int64(entry["index"])
        return sample

    def __getitem__(self, index: int) -> dict:
        return self.get(index)

    def __getstate__(self):  # open file handles stay behind when a worker process gets a copy
        return {**self.__dict__, "_open": {}}


REJECTED = "rejected_"
SHARED = ("prompt_embeds",)  # one prompt: its features serve both clips


class FeaturePairs:
    """The pairs of a feature cache built from clip pairs (mm_data.video.pairs: its ``pairs.json``),
    one sample each: the chosen clip's features, the rejected one's under ``rejected_<name>`` (the
    prompt's embedding once). A pair with a side missing from the cache or with clips of other
    feature shapes (they could not share a noise draw) is skipped and counted."""

    def __init__(self, folder: str, features: Optional[FeatureDataset] = None, max_bad_fraction: float = 0.05):
        path = os.path.join(folder, PAIR_LIST)
        if not os.path.isfile(path):
            raise ValueError(f"{folder} holds no {PAIR_LIST}: it was not built from clip pairs (a pair file of "
                             "prompt, chosen and rejected clips); build the cache from one")
        with open(path) as f:
            listed = json.load(f)
        self.features = features or FeatureDataset(folder)
        by_source = {self.features.source(i): i for i in range(len(self.features))}
        self.bad_input = BadInputLog(max_bad_fraction, total=len(listed))
        self.pairs, self.keys = [], []
        for entry in listed:
            chosen, rejected = by_source.get(entry["chosen"]), by_source.get(entry["rejected"])
            if chosen is None or rejected is None:
                missing = entry["chosen"] if chosen is None else entry["rejected"]
                self.bad_input.skip(BadSample(missing, "not in the feature cache (skipped while it was built): the "
                                                       "pair is left out"))
            elif self.features.keys[chosen] != self.features.keys[rejected]:
                self.bad_input.skip(BadSample(entry["chosen"], f"its features {self.features.keys[chosen]} differ "
                                                               f"in shape from the rejected clip's "
                                              f"{self.features.keys[rejected]} (another frame count or aspect "
                                              "bucket): the clips cannot share a noise draw"))
            else:
                self.pairs.append((chosen, rejected))
                self.keys.append(self.features.keys[chosen])
        self.bad_input.check()

    def __len__(self) -> int:
        return len(self.pairs)

    def source(self, index: int) -> str:
        return self.features.source(self.pairs[index][0])

    def get(self, index: int, epoch: int = 0) -> Dict[str, np.ndarray]:
        chosen, rejected = (self.features.get(i, epoch) for i in self.pairs[index])
        sample = dict(chosen)
        sample.update({REJECTED + name: value for name, value in rejected.items()
                       if name not in SHARED + ("index", "caption")})
        return sample

    def __getitem__(self, index: int) -> Dict[str, np.ndarray]:
        return self.get(index)
