"""Reading one shard: its blocks' row counts (from footers and headers) and one block's rows.

A *block* is the unit a shard is read in: a Parquet row group, an Arrow record batch, or up to
`TAR_BLOCK` consecutive samples of a WebDataset tar. Counting reads no row data: Parquet's
footer, Arrow's batch headers through a memory map, a tar's member headers (each member's data
is skipped by a seek). Reading a block touches only that block (a tar: its members, by offset).

Rows come out as dicts of Python values: Parquet / Arrow columns by name (binary columns as
bytes); a WebDataset sample as ``{"__key__": key, "__members__": [EXT, ...], EXT: bytes, ...}``
for its members ``KEY.EXT`` (the ``json`` member too: a sample's bad JSON is that sample's fault, parsed by the
caller).
"""

from __future__ import annotations

import os
import tarfile
from typing import Dict, List, Optional, Sequence, Tuple

from mm_data.errors import DataError

FORMATS = ("parquet", "webdataset", "arrow")
EXTENSIONS = {"parquet": (".parquet",), "webdataset": (".tar",), "arrow": (".arrow",)}
TAR_BLOCK = 64  # samples per block of a tar: a shuffle window's unit without a row-group structure


def _damaged(path: str, error: Exception, what: str) -> DataError:
    return DataError(f"shard {path} is damaged or not {what} ({type(error).__name__}: {error}); copy it again, "
                     "or rebuild the shards with `mm-data convert`")


def count_blocks(fmt: str, path: str) -> Tuple[int, ...]:
    """Rows of each block of shard ``path``, from its metadata."""
    if not os.path.isfile(path):
        raise DataError(f"shard {path} is missing; copy it back, or rebuild the shards with `mm-data convert`")
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            metadata = pq.ParquetFile(path).metadata
            return tuple(metadata.row_group(i).num_rows for i in range(metadata.num_row_groups))
        if fmt == "arrow":
            return tuple(batch.num_rows for batch in _arrow_batches(path))
        return tuple(len(members) for members in _tar_blocks(path))
    except DataError:
        raise
    except Exception as error:  # pyarrow / tarfile raise their own classes for a bad footer or header
        raise _damaged(path, error, f"a {fmt} shard") from None


def read_block(fmt: str, path: str, block: int, columns: Optional[Sequence[str]] = None) -> List[Dict]:
    """The rows of block ``block`` of shard ``path``; with ``columns`` only those of them the
    shard has (a tar: only the members of those extensions), the rest never read."""
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            shard = pq.ParquetFile(path)
            names = None if columns is None else [c for c in columns if c in shard.schema_arrow.names]
            return shard.read_row_group(block, columns=names).to_pylist()
        if fmt == "arrow":
            for number, batch in enumerate(_arrow_batches(path)):
                if number == block:
                    if columns is not None:
                        batch = batch.select([c for c in columns if c in batch.schema.names])
                    return batch.to_pylist()
            raise IndexError(f"no record batch {block}")
        return _read_tar_samples(path, _tar_blocks(path)[block], columns)
    except Exception as error:
        raise _damaged(path, error, f"a {fmt} shard") from None


def _arrow_batches(path: str):
    """The record batches of an Arrow IPC file or stream (Hugging Face's save_to_disk writes
    streams), memory-mapped: a batch's data is not read until used."""
    import pyarrow as pa

    source = pa.memory_map(path)
    try:
        reader = pa.ipc.open_file(source)
        return [reader.get_batch(i) for i in range(reader.num_record_batches)]
    except pa.ArrowInvalid:
        return list(pa.ipc.open_stream(pa.memory_map(path)))


# a tar's samples: [(key, [(extension, offset of data, size), ...]), ...], cached per (path, size, mtime)
_TAR_INDEX: Dict[tuple, list] = {}


def _tar_samples(path: str) -> list:
    stat = os.stat(path)
    key = (path, stat.st_size, stat.st_mtime_ns)
    if key not in _TAR_INDEX:
        samples, where = [], {}
        with tarfile.open(path, "r:") as tar:  # uncompressed: headers are read, data is seeked over
            for member in tar:
                if not member.isfile():
                    continue
                folder, name = os.path.split(member.name)
                stem, dot, extension = name.partition(".")
                if not dot or name.startswith("."):
                    continue  # WebDataset ignores names without an extension
                sample_key = os.path.join(folder, stem)
                if sample_key not in where:
                    where[sample_key] = len(samples)
                    samples.append((sample_key, []))
                samples[where[sample_key]][1].append((extension, member.offset_data, member.size))
        if len(_TAR_INDEX) > 64:
            _TAR_INDEX.clear()
        _TAR_INDEX[key] = samples
    return _TAR_INDEX[key]


def _tar_blocks(path: str) -> list:
    samples = _tar_samples(path)
    return [samples[start:start + TAR_BLOCK] for start in range(0, len(samples), TAR_BLOCK)]


def _read_tar_samples(path: str, samples: list, extensions: Optional[Sequence[str]] = None) -> List[Dict]:
    rows = []
    with open(path, "rb") as f:
        for key, members in samples:
            row = {"__key__": key, "__members__": [extension for extension, _, _ in members]}
            for extension, offset, size in members:
                if extensions is not None and extension not in extensions:
                    continue
                f.seek(offset)
                data = f.read(size)
                if len(data) != size:
                    raise EOFError(f"member {key}.{extension} is cut short")
                row[extension] = data
            rows.append(row)
    return rows
