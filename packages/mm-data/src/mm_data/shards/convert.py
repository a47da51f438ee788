"""Annotations + media files -> Parquet or WebDataset shards (`mm-data convert`).

VL data (LLaMA-Factory JSON / JSONL): each usable entry becomes a row in the order of the file:
its own fields as they are, its media embedded as bytes (``media="embed"``) or referenced by
paths relative to the output folder (``"reference"``), and ``media_info`` — each image's (height,
width), each video's (frames, fps, height, width), each audio's and each video track's samples at
16 kHz — so that packing and buckets need not open a medium to know its tokens. Video data (any
layout `mm_data.video.annotations` reads): a row per clip with its ``captions``, the clip as
``video`` (embedded or referenced) and its ``num_frames``, ``fps`` and ``resolution`` (from the
annotation, else a probe). An entry the training would skip or whose media cannot be read is left
out, counted and named (``report["skipped"]``). Shards hold ``rows_per_shard`` rows; a Parquet
shard's row groups ``rows_per_block`` (the unit the shuffle reads); the folder gets a
``manifest.json`` (`mm_data.shards.index`), so opening the set reads no shard.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

from mm_data.audio import load_audio
from mm_data.entries import json_entries
from mm_data.errors import BadInputLog, BadSample
from mm_data.shards.index import write_manifest

MEDIA_COLUMNS = ("images", "videos", "audios")
CONVERT_FORMATS = ("parquet", "webdataset")


def convert(annotations: str, out: str, fmt: str = "parquet", media: str = "embed", rows_per_shard: int = 1000,
            rows_per_block: int = 64, media_dir: Optional[str] = None, kind: str = "auto") -> Dict:
    """Write the shards of ``annotations`` into ``out`` (see the module docstring); returns a
    report: rows written, shards, entries skipped with their reasons. ``kind``: vl (LLaMA-Factory
    conversations), video (any layout of `mm_data.video.annotations`: a caption and a clip per
    row), auto (vl when the file's first entry is a conversation)."""
    if fmt not in CONVERT_FORMATS or media not in ("embed", "reference") or kind not in ("auto", "vl", "video"):
        raise ValueError(f"convert writes --format {' | '.join(CONVERT_FORMATS)} with --media embed | reference and "
                         f"--kind auto | vl | video, got {fmt} / {media} / {kind}")
    if rows_per_shard < 1 or rows_per_block < 1:
        raise ValueError("rows per shard and per block must be >= 1")
    os.makedirs(out, exist_ok=True)
    log = BadInputLog(max_bad_fraction=1.0)
    kind = _kind(annotations) if kind == "auto" else kind
    source_rows = (_vl_rows(annotations, out, media, media_dir, log) if kind == "vl"
                   else _video_rows(annotations, out, media, media_dir, log))
    rows: List[Dict] = []
    shards: List[str] = []
    written = 0
    for written, row in enumerate(source_rows, 1):
        rows.append(row)
        if len(rows) == rows_per_shard:
            shards.append(_write_shard(rows, out, len(shards), fmt, rows_per_block, media))
            rows = []
    if rows or not shards:
        shards.append(_write_shard(rows, out, len(shards), fmt, rows_per_block, media))
    manifest = write_manifest(out, fmt, shards, {"source": os.path.abspath(annotations), "media": media,
                                                 "kind": kind})
    return {"rows": written, "shards": len(shards), "manifest": manifest, "kind": kind, "skipped": list(log.skipped)}


def _kind(annotations: str) -> str:
    """vl when the first entry of a JSON / JSONL file is a conversation, else video."""
    if os.path.isfile(annotations) and annotations.endswith((".json", ".jsonl")):
        entries = json_entries(annotations, BadInputLog(max_bad_fraction=1.0))
        first = entries[0][1] if entries else {}
        if isinstance(first, dict) and ("messages" in first or "conversations" in first):
            return "vl"
    return "video"


def _vl_rows(annotations: str, out: str, media: str, media_dir: Optional[str], log: BadInputLog):
    from mm_data.vl.conversation import parse_entry

    media_dir = media_dir or os.path.dirname(os.path.abspath(annotations))
    for source, entry in json_entries(annotations, log):
        try:
            yield _row(entry, parse_entry(entry, source, media_dir), out, media)
        except BadSample as bad:
            log.skip(bad)


def _video_rows(annotations: str, out: str, media: str, media_dir: Optional[str], log: BadInputLog):
    """A row per usable record: its captions, its clip, its frame count, fps and size."""
    from mm_data.video.annotations import load_records
    from mm_data.video.decode import probe

    for record in load_records(annotations, log, media_dir):
        try:
            info = (record.num_frames, record.fps, record.height, record.width) if record.has_metadata else None
            if info is None:
                probed = probe(record.path)
                info = (probed.num_frames, probed.fps, probed.height, probed.width)
            yield {"captions": list(record.captions), "video": _medium(record.path, out, media),
                   "num_frames": int(info[0]), "fps": float(info[1]),
                   "resolution": {"height": int(info[2]), "width": int(info[3])}}
        except BadSample as bad:
            log.skip(bad)


def _row(entry: Dict, conversation, out: str, media: str) -> Dict:
    """The entry with its media embedded or re-pathed, and its media_info."""
    from mm_data.video.decode import probe
    from mm_data.vl.dataset import image_size

    row = {key: value for key, value in entry.items() if key not in MEDIA_COLUMNS}
    info = {"images": [list(image_size(path)) for path in conversation.images]}
    videos = [probe(path) for path in conversation.videos]
    info["videos"] = [[v.num_frames, v.fps, v.height, v.width] for v in videos]
    if conversation.audios or conversation.videos:  # samples at 16 kHz (Qwen2.5-Omni's audio lengths)
        info["audios"] = [load_audio(path).size for path in conversation.audios]
        info["video_audios"] = [_track_samples(path) for path in conversation.videos]
    for key in MEDIA_COLUMNS:
        paths = getattr(conversation, key)
        if paths:
            row[key] = [_medium(path, out, media) for path in paths]
    row["media_info"] = json.dumps(info)
    return row


def _track_samples(path: str) -> Optional[int]:
    """A video's audio track in samples at 16 kHz, or None when it has none."""
    try:
        return load_audio(path).size
    except BadSample as bad:
        if bad.reason == "no audio stream":
            return None
        raise


def _medium(path: str, out: str, media: str):
    if not os.path.isfile(path):
        raise BadSample(path, "file not found")
    if media == "reference":
        return os.path.relpath(os.path.abspath(path), os.path.abspath(out))
    with open(path, "rb") as f:
        return f.read()


def _write_shard(rows: List[Dict], out: str, number: int, fmt: str, rows_per_block: int, media: str) -> str:
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = os.path.join(out, f"shard-{number:05d}.parquet")
        columns = dict.fromkeys(key for row in rows for key in row)  # every row's keys (from_pylist reads the first's)
        table = pa.Table.from_pylist([{key: row.get(key) for key in columns} for row in rows])
        pq.write_table(table, path, row_group_size=rows_per_block)
        return path
    return _write_tar(rows, os.path.join(out, f"shard-{number:05d}.tar"), number, media)


def _write_tar(rows: List[Dict], path: str, number: int, media: str) -> str:
    """WebDataset: per row a ``KEY.json`` member (the entry; media lists name the members
    ``images.0.png``, ... when embedded) and one member per embedded medium."""
    import io
    import tarfile

    def add(tar, name: str, data: bytes):
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(data), 0o444, 0
        tar.addfile(info, io.BytesIO(data))

    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for index, row in enumerate(rows):
            key, entry, members = f"{number:05d}{index:06d}", dict(row), []
            for column in MEDIA_COLUMNS:
                if media == "embed" and column in entry:
                    names = [f"{column}.{i}{_extension(data)}" for i, data in enumerate(entry[column])]
                    members += list(zip(names, entry[column]))
                    entry[column] = names
            if media == "embed" and isinstance(entry.get("video"), bytes):  # a clip row's one video
                members.append((f"video{_extension(entry['video'])}", entry["video"]))
                entry["video"] = members[-1][0]
            add(tar, f"{key}.json", json.dumps(entry, ensure_ascii=False).encode())
            for name, data in members:
                add(tar, f"{key}.{name}", data)
    return path


def _extension(data: bytes) -> str:
    """A medium's usual extension from its first bytes (readers decode by content, not by name)."""
    if data.startswith(b"RIFF"):
        return {b"WAVE": ".wav", b"AVI ": ".avi", b"WEBP": ".webp"}.get(data[8:12], ".bin")
    signatures = ((b"\x89PNG", ".png"), (b"\xff\xd8", ".jpg"), (b"GIF8", ".gif"), (b"fLaC", ".flac"),
                  (b"ID3", ".mp3"), (b"\x1a\x45\xdf\xa3", ".mkv"))
    for signature, extension in signatures:
        if data.startswith(signature):
            return extension
    return ".mp4" if data[4:8] == b"ftyp" else ".bin"
