"""Video-text samples from shards: a caption and a clip per row (`mm_data.shards`).

A Parquet / Arrow row holds what an annotation entry holds (`mm_data.video.annotations`): the
caption (``cap`` / ``captions`` / ``caption`` / ``text``), the clip (``video``: bytes, Hugging
Face's {bytes, path} struct or a path from the shard's folder; or ``path`` / ``file``) and, when
known, ``num_frames``, ``fps`` and ``resolution`` {height, width} (or ``height`` / ``width``, or
``media_info``'s first video). A WebDataset sample holds a ``json`` member of those fields (its
``video`` naming a member, else the first member with a video extension is the clip) and / or a
``txt`` member with the caption (video2dataset's layout).

`shard_records` reads only those small fields of every row — never a clip — so buckets are known
before any decoding when the rows carry their metadata (`mm-data convert` writes it); a row
without it is probed when the data set is built. `clip_source` reads a row's clip when its sample is.
"""

from __future__ import annotations

import os
from typing import List, Optional

from mm_data.errors import BadInputLog, BadSample
from mm_data.shards import ShardSet, media_info, medium, tar_json
from mm_data.video.annotations import VIDEO_EXTENSIONS, VideoRecord, captions_of

METADATA = ("cap", "captions", "caption", "text", "num_frames", "fps", "resolution", "height", "width",
            "media_info")


def _entry(row: dict, source: str, fmt: str) -> dict:
    """The row's fields (a tar sample: its json member, its txt member as the caption)."""
    if fmt != "webdataset":
        return {key: value for key, value in row.items() if value is not None}
    entry = tar_json(row, source)
    if "txt" in row and not any(key in entry for key in ("cap", "captions", "caption", "text")):
        entry["caption"] = row["txt"].decode("utf-8", errors="replace").strip()
    return entry


def _metadata(entry: dict, source: str):
    """(num_frames, fps, height, width), each None when the row does not say."""
    resolution = entry.get("resolution") if isinstance(entry.get("resolution"), dict) else {}
    values = [entry.get("num_frames"), entry.get("fps"), resolution.get("height", entry.get("height")),
              resolution.get("width", entry.get("width"))]
    videos = (media_info(entry, source) or {}).get("videos")
    if None in values and videos:
        values = list(videos[0])
    try:
        return tuple(None if v is None else (float(v) if i == 1 else int(v)) for i, v in enumerate(values))
    except (TypeError, ValueError) as error:
        raise BadSample(source, f"malformed metadata: {error}") from None


def shard_records(shards: ShardSet, log: Optional[BadInputLog] = None) -> List[VideoRecord]:
    """A `VideoRecord` per usable row (``path``: where the row is, ``row``: its number); rows
    without a caption or with malformed metadata go to ``log``."""
    log = log if log is not None else BadInputLog()
    columns = ("json", "txt") if shards.format == "webdataset" else METADATA
    records = []
    for index, row in enumerate(shards.column_rows(columns)):
        source = shards.source(index)
        try:
            entry = _entry(row, source, shards.format)
            caption = next((entry[k] for k in ("cap", "captions", "caption", "text") if k in entry), None)
            records.append(VideoRecord(source, captions_of(caption, source), *_metadata(entry, source), row=index))
        except BadSample as bad:
            log.skip(bad)
    log.total = (log.total or 0) + len(shards)
    log.check()
    return records


def clip_source(shards: ShardSet, index: int):
    """Row ``index``'s clip: its bytes, or its path (relative ones from the shard's folder)."""
    row, source = shards.row(index), shards.source(index)
    if shards.format == "webdataset":
        entry = _entry(row, source, shards.format)
        named = entry.get("video")
        member = named if isinstance(named, str) and named in row else next(
            (ext for ext in row.get("__members__", []) if "." + ext.rsplit(".", 1)[-1].lower() in VIDEO_EXTENSIONS),
            None)
        if member is None:
            raise BadSample(source, f"sample {row['__key__']} has no video member ({', '.join(VIDEO_EXTENSIONS)})")
        return row[member]
    value = next((row[k] for k in ("video", "path", "file") if row.get(k) is not None), None)
    if value is None:
        raise BadSample(source, "no 'video' (or 'path' / 'file') field")
    clip = medium(value, source)
    return clip if isinstance(clip, bytes) or os.path.isabs(clip) else os.path.join(shards.folder(index), clip)
