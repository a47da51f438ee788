"""LLaMA-Factory's dataset_info.json: which file a named data set is, and how to read its entries.

An entry of dataset_info.json (LLaMA-Factory's data/README.md) names a data set and says where its
file is and how its entries are laid out:

    "my_set": {"file_name": "my_set.json", "formatting": "sharegpt" | "alpaca", "ranking": false,
               "columns": {"messages": "conversations", "system": "system", "tools": "tools",
                           "images": "images", "videos": "videos", "audios": "audios",
                           "prompt": "instruction", "query": "input", "response": "output",
                           "history": "history", "chosen": "chosen", "rejected": "rejected"},
               "tags": {"role_tag": "from", "content_tag": "value", "user_tag": "human",
                        "assistant_tag": "gpt", "observation_tag": "observation",
                        "function_tag": "function_call", "system_tag": "system"}}

Columns and tags left out take LLaMA-Factory's defaults (those above; alpaca has no history or
system column unless named). `DatasetFormat` holds one resolved entry; `load_dataset_info` reads
the named ones, and a wrong name or key is an error naming the data set and the key. Named with
ratios ({name: ratio}), the sets are mixed in those shares as LLaMA-Factory's interleave_under
mixes them (`mm_data.vl.conversation.mix`). Data sets on a hub (hf_hub_url, ms_hub_url,
script_url) are refused: nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union

FORMATTINGS = ("alpaca", "sharegpt")
SHAREGPT_COLUMNS = {"messages": "conversations", "system": None, "tools": None, "images": "images",
                    "videos": "videos", "audios": "audios", "chosen": "chosen", "rejected": "rejected", "kto_tag": None}
ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "history": None, "system": None,
                  "tools": None, "images": "images", "videos": "videos", "audios": "audios", "chosen": "chosen",
                  "rejected": "rejected", "kto_tag": None}
TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
        "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}
_HUB_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
_KNOWN_KEYS = {"file_name", "file_sha1", "formatting", "ranking", "columns", "tags", "subset", "split", "folder",
               "num_samples"} | set(_HUB_KEYS)  # subset, split, folder: hub sets' (a local file has one split)


@dataclass(frozen=True)
class DatasetFormat:
    """One data set of a dataset_info.json, resolved: its file and how to read an entry."""

    name: str
    path: str
    formatting: str = "sharegpt"
    ranking: bool = False
    columns: Dict[str, Optional[str]] = field(default_factory=lambda: dict(SHAREGPT_COLUMNS))
    tags: Dict[str, str] = field(default_factory=lambda: dict(TAGS))
    num_samples: Optional[int] = None
    ratio: Optional[float] = None  # its share when data sets are mixed (given with the name)

    @classmethod
    def default(cls, path: str) -> "DatasetFormat":
        """A plain LLaMA-Factory file without a dataset_info.json (either chat layout, told apart
        per entry: `mm_data.vl.conversation`)."""
        return cls(name=os.path.basename(path), path=path)


def _error(info_path: str, name: str, detail: str) -> ValueError:
    return ValueError(f"{info_path}: data set {name!r}: {detail}")


def _mapping(entry: dict, key: str, defaults: dict, info_path: str, name: str) -> dict:
    given = entry.get(key) or {}
    if not isinstance(given, dict):
        raise _error(info_path, name, f"'{key}' must be an object, got {type(given).__name__}")
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise _error(info_path, name, f"unknown {key} key(s) {unknown}; LLaMA-Factory's are {sorted(defaults)}")
    return {**defaults, **given}


def _resolve(info_path: str, name: str, entry) -> DatasetFormat:
    if not isinstance(entry, dict):
        raise _error(info_path, name, f"expected an object, got {type(entry).__name__}")
    hub = [k for k in _HUB_KEYS if k in entry]
    if hub and "file_name" not in entry:
        raise _error(info_path, name, f"{hub[0]} is a hub data set: mm reads local files only; download it and "
                                      "give its file_name")
    unknown = sorted(set(entry) - _KNOWN_KEYS)
    if unknown:
        raise _error(info_path, name, f"unknown key(s) {unknown}")
    if "file_name" not in entry:
        raise _error(info_path, name, "no 'file_name'")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in FORMATTINGS:
        raise _error(info_path, name, f"formatting {formatting!r} is not one of {FORMATTINGS}")
    columns = _mapping(entry, "columns", SHAREGPT_COLUMNS if formatting == "sharegpt" else ALPACA_COLUMNS,
                       info_path, name)
    tags = _mapping(entry, "tags", TAGS, info_path, name)
    if formatting == "alpaca" and entry.get("tags"):
        raise _error(info_path, name, "'tags' belong to the sharegpt formatting")
    path = os.path.join(os.path.dirname(os.path.abspath(info_path)), entry["file_name"])
    if not os.path.exists(path):
        raise _error(info_path, name, f"file_name {entry['file_name']!r}: {path} does not exist")
    return DatasetFormat(name, path, formatting, bool(entry.get("ranking", False)), columns, tags,
                         entry.get("num_samples"))


def load_dataset_info(info_path: str, names: Union[str, Sequence[str], Dict[str, float]]) -> List[DatasetFormat]:
    """The named data sets of a dataset_info.json (a file, or the folder holding one), in order;
    ``names`` a mapping {name: ratio} mixes them in those shares (`mm_data.vl.conversation.mix`)."""
    if os.path.isdir(info_path):
        info_path = os.path.join(info_path, "dataset_info.json")
    with open(info_path, encoding="utf-8") as f:
        info = json.load(f)
    if not isinstance(info, dict):
        raise ValueError(f"{info_path}: expected an object of data sets, got {type(info).__name__}")
    ratios = dict(names) if isinstance(names, dict) else {}
    if any(not isinstance(r, (int, float)) or isinstance(r, bool) or r <= 0 for r in ratios.values()):
        raise ValueError(f"{info_path}: the data sets' ratios must be positive numbers, got {ratios}")
    names = [names] if isinstance(names, str) else list(names)
    missing = [n for n in names if n not in info]
    if missing:
        raise ValueError(f"{info_path}: no data set named {missing}; it has {sorted(info)}")
    total = sum(ratios.values())
    return [dataclasses.replace(_resolve(info_path, name, info[name]),
                                ratio=ratios[name] / total if ratios else None) for name in names]
