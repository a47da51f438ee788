"""Annotation files as (source, entry) pairs, and parsing them with bad entries skipped.

`json_entries` reads a JSON list (``[...]``) or JSON lines; each entry is named by its source
(``file[i]`` or ``file:line``) so a skip says where to look. A malformed line is a bad entry; a
malformed JSON list is an error (nothing in it can be trusted).
"""

from __future__ import annotations

import json
from typing import Callable, List, Tuple, TypeVar

from mm_data.errors import BadInputLog, BadSample

T = TypeVar("T")


def json_entries(path: str, log: BadInputLog) -> List[Tuple[str, object]]:
    """(source, parsed JSON value) per entry of ``path``; malformed lines go to ``log``."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        whole = json.loads(text)
    except json.JSONDecodeError as error:
        if text.lstrip().startswith("["):
            raise ValueError(f"{path} is not valid JSON ({error}); expected a list of entries") from None
        whole = None  # JSON lines
    if whole is not None:
        if not isinstance(whole, list):
            raise ValueError(f"{path} holds one JSON {type(whole).__name__}; expected a list of entries or JSON lines")
        return [(f"{path}[{i}]", value) for i, value in enumerate(whole)]
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                entries.append((f"{path}:{number}", json.loads(line)))
            except json.JSONDecodeError as error:
                log.skip(BadSample(f"{path}:{number}", f"malformed JSON line: {error}"))
    return entries


def parse_all(entries: List[Tuple[str, object]], parse: Callable[[object, str], T], log: BadInputLog) -> List[T]:
    """``parse(entry, source)`` of every entry; those raising `BadSample` go to ``log``."""
    parsed = []
    for source, entry in entries:
        try:
            parsed.append(parse(entry, source))
        except BadSample as bad:
            log.skip(bad)
    return parsed
