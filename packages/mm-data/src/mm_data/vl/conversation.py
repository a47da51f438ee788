"""Vision-language SFT data in LLaMA-Factory's multimodal formats, read into `Conversation`s.

Two layouts, told apart per entry:
- ``{"messages": [{"role": "user" | "assistant" | "system", "content": "... <image> ..."}, ...],
  "images": [...], "videos": [...], "audios": [...]}``
- ShareGPT: ``{"conversations": [{"from": "human" | "gpt" | "system", "value": ...}, ...],
  "system": ..., "images": [...], ...}``

A file is a JSON list or JSON lines. Media paths are relative to ``media_dir`` (default: the
file's folder). The number of ``<image>`` / ``<video>`` / ``<audio>`` placeholders must equal the
length of the matching list, turns must alternate user / assistant and end with the assistant:
an entry that breaks a rule is a `BadSample` (skipped and counted by the caller's log).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from mm_data.entries import json_entries, parse_all
from mm_data.errors import BadInputLog, BadSample

PLACEHOLDERS = {"images": "<image>", "videos": "<video>", "audios": "<audio>"}
ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "system": "system"}


@dataclass(frozen=True)
class Conversation:
    """Alternating (role, text) turns, user first; media paths in placeholder order."""

    turns: Tuple[Tuple[str, str], ...]
    system: Optional[str] = None
    images: Tuple[str, ...] = field(default_factory=tuple)
    videos: Tuple[str, ...] = field(default_factory=tuple)
    audios: Tuple[str, ...] = field(default_factory=tuple)
    source: str = ""


def parse_entry(entry, source: str, media_dir: str = "") -> Conversation:
    """One LLaMA-Factory entry (either layout) as a checked `Conversation`."""
    if not isinstance(entry, dict):
        raise BadSample(source, f"expected an object, got {type(entry).__name__}")
    if "messages" in entry:
        raw, role_key, text_key = entry["messages"], "role", "content"
    elif "conversations" in entry:
        raw, role_key, text_key = entry["conversations"], "from", "value"
    else:
        raise BadSample(source, "no 'messages' or 'conversations' list")
    key = "messages" if "messages" in entry else "conversations"
    if not isinstance(raw, list):
        raise BadSample(source, f"'{key}' must be a list of messages, got {type(raw).__name__}")
    if not raw:
        raise BadSample(source, f"'{key}' is an empty list")
    system = entry.get("system") if isinstance(entry.get("system"), str) else None
    turns = []
    for number, message in enumerate(raw):
        if not isinstance(message, dict) or not isinstance(message.get(text_key), str):
            raise BadSample(source, f"message {number} has no text field {text_key!r}")
        role = ROLES.get(message.get(role_key))
        if role is None:
            raise BadSample(source, f"message {number} has role {message.get(role_key)!r}; "
                                    f"expected one of {sorted(ROLES)}")
        if role == "system":
            if number:
                raise BadSample(source, "a system message may only come first")
            system = message[text_key]
            continue
        turns.append((role, message[text_key]))
    expected = ["user", "assistant"] * (len(turns) // 2 + 1)
    if not turns or [role for role, _ in turns] != expected[:len(turns)] or turns[-1][0] != "assistant":
        raise BadSample(source, f"turns must alternate user / assistant and end with the assistant, got "
                                f"{[role for role, _ in turns]}")
    media = {}
    for key, placeholder in PLACEHOLDERS.items():
        paths = entry.get(key) or []
        paths = [paths] if isinstance(paths, str) else paths
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise BadSample(source, f"'{key}' must be a list of paths")
        count = sum(text.count(placeholder) for _, text in turns) + (system or "").count(placeholder)
        if count != len(paths):
            raise BadSample(source, f"{count} {placeholder} placeholders but {len(paths)} {key}")
        media[key] = tuple(p if os.path.isabs(p) or "://" in p else os.path.join(media_dir, p) for p in paths)
    return Conversation(tuple(turns), system, media["images"], media["videos"], media["audios"], source)


def read_conversations(path: str, media_dir: Optional[str] = None,
                       log: Optional[BadInputLog] = None) -> List[Conversation]:
    """Every usable conversation of a LLaMA-Factory JSON / JSONL file; bad entries go to ``log``."""
    log = log if log is not None else BadInputLog()
    media_dir = media_dir if media_dir is not None else os.path.dirname(os.path.abspath(path))
    before = log.count
    entries = json_entries(path, log)
    malformed = log.count - before
    conversations = parse_all(entries, lambda entry, source: parse_entry(entry, source, media_dir), log)
    log.total = (log.total or 0) + len(entries) + malformed
    log.check()
    return conversations
