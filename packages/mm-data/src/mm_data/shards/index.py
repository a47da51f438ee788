"""A set of shards as one numbered sequence of rows, read a block at a time.

`ShardSet.open(path, fmt)` takes a folder of shards, a glob, or a manifest (``manifest.json``,
written by `mm-data convert`: each shard's path, size in bytes and rows per block, so opening
reads no shard at all). Without a manifest each shard's footer / headers are read for its block
sizes (no row data). Sample ``i`` is a (block, row) by the cumulative block sizes; `row(i)` reads
its block and keeps the last `cached_blocks` blocks, so the samples of a shuffle window (see
`mm_data.sampler`'s block order) cost one read per block.

Before anything trains, `check` names a shard that is missing, has another size than the
manifest records, or whose ending is not its format's (a copy cut short), with what to do.
"""

from __future__ import annotations

import glob
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np

from mm_data.errors import DataError
from mm_data.shards.formats import EXTENSIONS, FORMATS, count_blocks, read_block

MANIFEST = "manifest.json"
# how each format's file ends when whole: Parquet's footer magic, an Arrow IPC file's magic or a
# stream's end-of-stream marker, a tar's zero blocks
_ENDINGS = {"parquet": (b"PAR1",), "arrow": (b"ARROW1", b"\xff\xff\xff\xff\x00\x00\x00\x00")}


@dataclass(frozen=True)
class Shard:
    path: str
    blocks: Tuple[int, ...]  # rows of each block
    size: int  # bytes, as indexed


class ShardSet:
    """See the module docstring."""

    def __init__(self, fmt: str, shards: Sequence[Shard], manifest: str = "", cached_blocks: int = 8):
        if fmt not in FORMATS:
            raise ValueError(f"data.format {fmt!r} is not a shard format; use one of {list(FORMATS)}")
        self.format, self.shards, self.manifest = fmt, list(shards), manifest
        sizes = [rows for shard in self.shards for rows in shard.blocks]
        self.block_shard = [(s, b) for s, shard in enumerate(self.shards) for b in range(len(shard.blocks))]
        self.block_start = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
        self.cached_blocks, self._cache = cached_blocks, OrderedDict()
        self.reads = 0  # blocks read so far (a resume must read none it skips)

    @classmethod
    def open(cls, path: str, fmt: str, **kwargs) -> "ShardSet":
        """The shards at ``path``: a manifest file, a folder holding one, a folder of shards, or a glob."""
        manifest = path if os.path.isfile(path) and path.endswith(".json") else os.path.join(path, MANIFEST)
        if os.path.isfile(manifest):
            return cls.from_manifest(manifest, fmt, **kwargs)
        if os.path.isdir(path):
            paths = sorted(p for ext in EXTENSIONS[fmt] for p in glob.glob(os.path.join(path, "**", "*" + ext),
                                                                             recursive=True))
        else:
            paths = sorted(glob.glob(path))
        if not paths:
            raise DataError(f"no {fmt} shards ({'/'.join(EXTENSIONS[fmt])}) at {path}; point data.path at their "
                            f"folder, a glob or a {MANIFEST}, or set data.format to the shards' format")
        return cls(fmt, [Shard(p, count_blocks(fmt, p), os.path.getsize(p)) for p in paths], **kwargs)

    @classmethod
    def from_manifest(cls, manifest: str, fmt: str, **kwargs) -> "ShardSet":
        with open(manifest) as f:
            record = json.load(f)
        if record.get("format") != fmt:
            raise DataError(f"{manifest} describes {record.get('format')} shards, data.format says {fmt}; set "
                            "data.format to match")
        folder = os.path.dirname(os.path.abspath(manifest))
        shards = [Shard(os.path.join(folder, s["path"]), tuple(s["blocks"]), int(s["bytes"])) for s in record["shards"]]
        shard_set = cls(fmt, shards, manifest=manifest, **kwargs)
        shard_set.check()
        return shard_set

    def check(self) -> None:
        """Every shard present, of the indexed size, ending as its format does (see the module docstring)."""
        for shard in self.shards:
            if not os.path.isfile(shard.path):
                raise DataError(f"shard {shard.path} is missing; copy it back, or rebuild the shards with "
                                "`mm-data convert`")
            size = os.path.getsize(shard.path)
            if size != shard.size:
                raise DataError(f"shard {shard.path} has {size} bytes, {self.manifest or 'its index'} says "
                                f"{shard.size}: it was cut short or replaced; copy it again, or rebuild the shards "
                                "with `mm-data convert`")
            if not self._ends_whole(shard.path, size):
                raise DataError(f"shard {shard.path} does not end as a {self.format} file does (a copy cut short?); "
                                "copy it again, or rebuild the shards with `mm-data convert`")

    def _ends_whole(self, path: str, size: int) -> bool:
        if self.format == "webdataset":
            return size % 512 == 0
        with open(path, "rb") as f:
            f.seek(max(size - 8, 0))
            tail = f.read()
        return any(tail.endswith(ending) for ending in _ENDINGS[self.format])

    def __len__(self) -> int:
        return int(self.block_start[-1])

    @property
    def block_sizes(self) -> List[int]:
        """Rows of each block, in shard order: what the sampler's block order shuffles."""
        return np.diff(self.block_start).tolist()

    def locate(self, index: int) -> Tuple[int, int]:
        """(block, row in the block) of sample ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is outside the {len(self)} rows of the shards")
        block = int(np.searchsorted(self.block_start, index, side="right")) - 1
        return block, index - int(self.block_start[block])

    def block(self, block: int) -> List[Dict]:
        if block in self._cache:
            self._cache.move_to_end(block)
            return self._cache[block]
        shard, within = self.block_shard[block]
        rows = read_block(self.format, self.shards[shard].path, within)
        self.reads += 1
        self._cache[block] = rows
        if len(self._cache) > self.cached_blocks:
            self._cache.popitem(last=False)
        return rows

    def column_rows(self, columns: Sequence[str]) -> List[Dict]:
        """Every row with only ``columns`` (a tar: member extensions) read: a data set's metadata
        (captions, frame counts, sizes) without its media. Not cached."""
        rows = []
        for shard, within in self.block_shard:
            rows += read_block(self.format, self.shards[shard].path, within, columns)
        return rows

    def block_of(self, index: int) -> int:
        return self.locate(index)[0]

    def row(self, index: int) -> Dict:
        block, row = self.locate(index)
        return self.block(block)[row]

    def source(self, index: int) -> str:
        """Where sample ``index`` lives, for a bad sample's message: ``shard[row in shard]``."""
        block, row = self.locate(index)
        shard, within = self.block_shard[block]
        return f"{self.shards[shard].path}[{sum(self.shards[shard].blocks[:within]) + row}]"

    def folder(self, index: int) -> str:
        """The folder of sample ``index``'s shard: where its relative media paths start."""
        return os.path.dirname(os.path.abspath(self.shards[self.block_shard[self.locate(index)[0]][0]].path))


def write_manifest(folder: str, fmt: str, shards: Sequence[str], extra: Dict = None) -> str:
    """``folder``/manifest.json for the shard files ``shards`` (paths under ``folder``)."""
    record = {"format": fmt, "rows": 0, "shards": []}
    for path in shards:
        blocks = count_blocks(fmt, path)
        record["shards"].append({"path": os.path.relpath(path, folder), "bytes": os.path.getsize(path),
                                 "blocks": list(blocks)})
        record["rows"] += sum(blocks)
    record.update(extra or {})
    out = os.path.join(folder, MANIFEST)
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    return out
