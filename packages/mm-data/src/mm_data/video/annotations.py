"""Video-text annotations in the layouts users already have, read into `VideoRecord`s.

- ``data.json`` (the reference suite's): a list of ``{"path", "cap", "num_frames", "fps",
  "resolution": {"height", "width"}}``, paths relative to a video folder; ``cap`` a string or a
  list of captions.
- ``data.txt``: lines ``video_folder,annotation.json`` combining several such sets (relative
  paths are taken from the txt file's folder).
- ``data.jsonl`` (CogVideoX style): one ``{"file", "captions"}`` object per line, paths relative to
  the jsonl's folder (``path`` / ``video`` and ``caption`` / ``cap`` / ``text`` are accepted too).
- a folder with ``videos/NAME.mp4`` and ``labels/NAME.txt``.
- MindSpeed-MM's ``data.json`` (its dataset config: ``dataset_param.basic_parameters`` with
  ``data_path``, a .jsonl or .json of such entries, and ``data_folder``, where their paths start;
  either relative to the config's folder).

`load_records` picks the reader from the path. Entries that cannot be used (malformed line, no
path, missing file, no caption) are skipped through the `BadInputLog`, never dropped silently.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

from mm_data.entries import json_entries, parse_all
from mm_data.errors import BadInputLog, BadSample

VIDEO_EXTENSIONS = (".mp4", ".avi", ".mkv", ".mov", ".webm", ".m4v", ".mpg", ".mpeg")


@dataclass(frozen=True)
class VideoRecord:
    """One video and its captions; frame count, fps and size when the annotation gives them."""

    path: str
    captions: Tuple[str, ...]
    num_frames: Optional[int] = None
    fps: Optional[float] = None
    height: Optional[int] = None
    width: Optional[int] = None
    row: Optional[int] = None  # the row of a sharded set (mm_data.video.shards) whose clip this is

    @property
    def has_metadata(self) -> bool:
        return None not in (self.num_frames, self.fps, self.height, self.width)


def captions_of(value, source: str) -> Tuple[str, ...]:
    captions = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (list, tuple)) else ()
    captions = tuple(c for c in captions if isinstance(c, str) and c.strip())
    if not captions:
        raise BadSample(source, "no caption")
    return captions


def _record(entry, folder: str, source: str) -> VideoRecord:
    if not isinstance(entry, dict):
        raise BadSample(source, f"expected an object, got {type(entry).__name__}")
    path = next((entry[k] for k in ("path", "file", "video") if isinstance(entry.get(k), str)), None)
    if not path:
        raise BadSample(source, "no 'path' (or 'file' / 'video') field")
    path = os.path.join(folder, path)
    if not os.path.isfile(path):
        raise BadSample(path, "file not found")
    caption = next((entry[k] for k in ("cap", "captions", "caption", "text") if k in entry), None)
    resolution = entry.get("resolution") if isinstance(entry.get("resolution"), dict) else {}
    try:
        return VideoRecord(path, captions_of(caption, path),
                           int(entry["num_frames"]) if entry.get("num_frames") is not None else None,
                           float(entry["fps"]) if entry.get("fps") is not None else None,
                           int(resolution["height"]) if resolution.get("height") is not None else None,
                           int(resolution["width"]) if resolution.get("width") is not None else None)
    except (TypeError, ValueError) as error:
        raise BadSample(source, f"malformed metadata: {error}") from None


def read_data_json(path: str, folder: str = "", log: Optional[BadInputLog] = None) -> List[VideoRecord]:
    """The reference suite's data.json; video paths relative to ``folder``."""
    log = log if log is not None else BadInputLog()
    return parse_all(json_entries(path, log), lambda entry, source: _record(entry, folder, source), log)


def read_data_txt(path: str, log: Optional[BadInputLog] = None) -> List[VideoRecord]:
    """Lines ``video_folder,annotation.json``; each set read with `read_data_json`."""
    log = log if log is not None else BadInputLog()
    base, records = os.path.dirname(os.path.abspath(path)), []
    with open(path, encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    for number, line in enumerate(lines, 1):
        folder, _, annotation = (part.strip() for part in line.rpartition(","))
        if not folder or not annotation:
            raise ValueError(f"{path} line {number}: expected 'video_folder,annotation.json', got {line!r}")
        records += read_data_json(os.path.join(base, annotation), os.path.join(base, folder), log)
    return records


def read_jsonl(path: str, log: Optional[BadInputLog] = None, folder: Optional[str] = None) -> List[VideoRecord]:
    """One JSON object per line (``file`` + ``captions``); paths relative to ``folder`` (default:
    the file's folder)."""
    log = log if log is not None else BadInputLog()
    folder = os.path.dirname(os.path.abspath(path)) if folder is None else folder
    return parse_all(json_entries(path, log), lambda entry, source: _record(entry, folder, source), log)


def mindspeed_dataset_config(path: str) -> Optional[dict]:
    """The ``basic_parameters`` of a MindSpeed-MM dataset config (a JSON object with
    ``dataset_param``), or None for any other .json."""
    import json

    with open(path, encoding="utf-8") as f:
        head = f.read(1024).lstrip()
        if not head.startswith("{") or "dataset_param" not in head + f.read():
            return None
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    basic = config.get("dataset_param", {}).get("basic_parameters") if isinstance(config, dict) else None
    if not isinstance(basic, dict) or not isinstance(basic.get("data_path"), str):
        raise ValueError(f"{path}: a MindSpeed-MM dataset config needs dataset_param.basic_parameters.data_path")
    return basic


def read_mindspeed_data_json(path: str, log: Optional[BadInputLog] = None) -> List[VideoRecord]:
    """MindSpeed-MM's data.json: its data_path's entries, video paths under its data_folder."""
    log = log if log is not None else BadInputLog()
    basic, base = mindspeed_dataset_config(path), os.path.dirname(os.path.abspath(path))
    data_path = os.path.join(base, basic["data_path"])
    folder = os.path.join(base, basic.get("data_folder") or os.path.dirname(data_path))
    if not os.path.isfile(data_path):
        raise ValueError(f"{path}: its data_path {data_path} is not a file")
    if data_path.endswith(".jsonl"):
        return read_jsonl(data_path, log, folder)
    return read_data_json(data_path, folder, log)


def read_video_folder(root: str, log: Optional[BadInputLog] = None) -> List[VideoRecord]:
    """``root/videos/NAME.ext`` with its caption in ``root/labels/NAME.txt``."""
    log = log if log is not None else BadInputLog()
    videos, labels = os.path.join(root, "videos"), os.path.join(root, "labels")
    if not os.path.isdir(videos):
        raise ValueError(f"{root} has no videos/ folder; expected videos/NAME.mp4 with labels/NAME.txt")
    entries = []
    for name in sorted(os.listdir(videos)):
        stem, extension = os.path.splitext(name)
        if extension.lower() not in VIDEO_EXTENSIONS:
            continue
        label = os.path.join(labels, stem + ".txt")
        if not os.path.isfile(label):
            log.skip(BadSample(os.path.join(videos, name), f"no caption file {label}"))
            continue
        with open(label, encoding="utf-8") as f:
            entries.append((label, {"path": name, "cap": f.read().strip()}))
    return parse_all(entries, lambda entry, source: _record(entry, videos, source), log)


def load_records(path: str, log: Optional[BadInputLog] = None, folder: Optional[str] = None) -> List[VideoRecord]:
    """Read ``path`` with the reader its form implies: folder, .txt, .json or .jsonl.

    ``folder`` is where a lone data.json's video paths start (default: the json's own folder).
    """
    log = log if log is not None else BadInputLog()
    if os.path.isdir(path):
        records = read_video_folder(path, log)
    elif path.endswith(".txt"):
        records = read_data_txt(path, log)
    elif path.endswith(".jsonl"):
        records = read_jsonl(path, log)
    elif path.endswith(".json") and mindspeed_dataset_config(path) is not None:
        records = read_mindspeed_data_json(path, log)
    elif path.endswith(".json"):
        records = read_data_json(path, folder if folder is not None else os.path.dirname(os.path.abspath(path)), log)
    else:
        raise ValueError(f"cannot tell the annotation layout of {path!r}: give a videos/ + labels/ folder, "
                         f"data.txt (folder,json lines), data.json (or MindSpeed-MM's) or data.jsonl")
    log.total = len(records) + log.count
    log.check()
    return records
