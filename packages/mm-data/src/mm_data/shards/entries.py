"""Shard rows as the entries the data sets parse, read only when a sample is asked for.

A Parquet / Arrow row is an entry as it stands: LLaMA-Factory's columns (``messages`` or
``conversations``, ``images``, ``videos``, ``audios``, ...) or a clip's (``caption``, ``video``).
A WebDataset sample's ``json`` member is its entry; a media item there that names one of the
sample's members (``"jpg"``, ``"image.0.png"``: the part of the member's name after the key) is
that member's bytes. A medium is a path (relative to its shard's folder), bytes, or Hugging Face's
``{"bytes", "path"}`` struct (its Image / Video features).

``media_info`` (written by `mm-data convert`, JSON text) gives each medium's size without
opening it: ``{"images": [[height, width]], "videos": [[frames, fps, height, width]], "audios":
[samples at 16 kHz], "video_audios": [each video's track in samples at 16 kHz, or null]}``.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Dict, Sequence, TypeVar

from mm_data.errors import BadSample
from mm_data.shards.index import ShardSet

T = TypeVar("T")
MEDIA_KEYS = ("images", "videos", "audios", "video")
MEDIA_INFO = "media_info"


def medium(value, source: str):
    """A medium as a path (str) or its bytes."""
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str) and value:
        return value
    raise BadSample(source, f"a medium must be a path, bytes or a {{bytes, path}} struct, got {type(value).__name__}")


def media_info(entry: Dict, source: str):
    """The entry's ``media_info`` (see the module docstring), or None."""
    info = entry.get(MEDIA_INFO)
    if info is None:
        return None
    try:
        return json.loads(info) if isinstance(info, (str, bytes)) else dict(info)
    except (ValueError, TypeError) as error:
        raise BadSample(source, f"unreadable {MEDIA_INFO}: {error}") from None


def row_entry(shards: ShardSet, index: int) -> Dict:
    """Sample ``index``'s entry with its media resolved to paths or bytes."""
    row, source = shards.row(index), shards.source(index)
    if shards.format != "webdataset":  # a null cell is an absent key (a column of the other chat layout)
        entry = {key: value for key, value in row.items() if value is not None}
    else:
        if "json" not in row:
            raise BadSample(source, f"sample {row['__key__']} has no .json member (its entry)")
        entry = tar_json(row, source)
        for key in MEDIA_KEYS:
            items = entry.get(key)
            if isinstance(items, str) or isinstance(items, list):
                entry[key] = _members(row, items, source, shards.folder(index))
    for key in MEDIA_KEYS:
        items = entry.get(key)
        if isinstance(items, list):
            entry[key] = [medium(item, source) for item in items]
        elif items is not None and not isinstance(items, str):
            entry[key] = medium(items, source)
    return entry


def tar_json(row: Dict, source: str) -> Dict:
    """A tar sample's ``json`` member as an object ({} without one); bad JSON is a `BadSample`."""
    if "json" not in row:
        return {}
    try:
        entry = json.loads(row["json"])
    except ValueError as error:
        raise BadSample(source, f"sample {row['__key__']}'s .json member is not JSON: {error}") from None
    if not isinstance(entry, dict):
        raise BadSample(source, f"sample {row['__key__']}'s .json member is not an object")
    return entry


def _members(row: Dict, items, source: str, folder: str):
    """Items naming one of the sample's members replaced by its bytes; others are paths, and one
    that is neither a member nor a file (from the shard's folder) is a `BadSample` saying so."""
    def one(item):
        if isinstance(item, str) and item in row and item not in ("json", "__key__", "__members__"):
            return row[item]
        if isinstance(item, str) and not os.path.exists(os.path.join(folder, item)):
            raise BadSample(source, f"sample {row['__key__']} names {item!r}, which is neither one of its members "
                                    f"({', '.join(row.get('__members__', []))}) nor a file beside the shard")
        return item
    return one(items) if isinstance(items, str) else [one(item) for item in items]


class ShardEntries(Sequence):
    """The parsed samples of a `ShardSet`, parsed when asked for: ``parse(entry, source, folder)``
    (a bad row raises `BadSample` then, counted by the loader like any bad sample)."""

    def __init__(self, shards: ShardSet, parse: Callable[[Dict, str, str], T]):
        self.shards, self.parse = shards, parse

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, index: int) -> T:
        if isinstance(index, slice):
            raise TypeError("shard entries are read one at a time")
        return self.parse(row_entry(self.shards, index), self.shards.source(index), self.shards.folder(index))
