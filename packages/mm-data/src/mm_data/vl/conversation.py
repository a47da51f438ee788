"""Vision-language SFT data in LLaMA-Factory's multimodal formats, read into `Conversation`s.

Two layouts, told apart per entry:
- ``{"messages": [{"role": "user" | "assistant" | "system", "content": "... <image> ..."}, ...],
  "images": [...], "videos": [...], "audios": [...]}``
- ShareGPT: ``{"conversations": [{"from": "human" | "gpt" | "system", "value": ...}, ...],
  "system": ..., "images": [...], ...}``
or, for a data set declared in a dataset_info.json (`mm_data.vl.dataset_info.DatasetFormat`), the
columns and tags it names: sharegpt with any message column and role / content / user / assistant
/ system tags, alpaca (instruction, input, output, history, system columns), and ``ranking`` sets
whose chosen / rejected answers end the conversation (``Conversation.rejected``) — told from the
entry too, by its "chosen" / "rejected" keys (an assistant message, or its text). A pair shares
its prompt and media, so the two answers cannot disagree on them; a missing side or two equal
answers are bad samples.

A file is a JSON list or JSON lines. Media paths are relative to ``media_dir`` (default: the
file's folder). The number of ``<image>`` / ``<video>`` / ``<audio>`` placeholders must equal the
length of the matching list, turns must alternate user / assistant and end with the assistant:
an entry that breaks a rule is a `BadSample` (skipped and counted by the caller's log), as is a
tool turn (observation / function tags: mm's chat templates have no tool format).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

from mm_data.entries import json_entries, parse_all
from mm_data.errors import BadInputLog, BadSample
from mm_data.shards import ShardEntries, ShardSet, media_info
from mm_data.vl.dataset_info import SHAREGPT_COLUMNS, TAGS, DatasetFormat

Medium = Union[str, bytes]  # a path, or the file's bytes (a sample inside a shard)
PLACEHOLDERS = {"images": "<image>", "videos": "<video>", "audios": "<audio>"}
ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant", "system": "system"}


@dataclass(frozen=True)
class Conversation:
    """Alternating (role, text) turns, user first; media paths in placeholder order; for a
    preference pair the rejected answer in place of the last assistant turn."""

    turns: Tuple[Tuple[str, str], ...]
    system: Optional[str] = None
    images: Tuple[Medium, ...] = field(default_factory=tuple)
    videos: Tuple[Medium, ...] = field(default_factory=tuple)
    audios: Tuple[Medium, ...] = field(default_factory=tuple)
    source: str = ""
    rejected: Optional[str] = None
    solution: Optional[str] = None  # a prompt's reference answer (mm_data.vl.prompts)
    # each medium's size without opening it, from a shard's media_info (mm_data.shards): {"images":
    # [[height, width]], "videos": [[frames, fps, height, width]]}
    media_info: Optional[dict] = None


def _text(value, source: str, what: str) -> str:
    if not isinstance(value, str):
        raise BadSample(source, f"{what} must be text, got {type(value).__name__}")
    return value


def _detected(entry: dict, source: str) -> DatasetFormat:
    """The layout of an entry read without a dataset_info.json: "messages" (role / content,
    OpenAI's role names) or ShareGPT's "conversations" (from / value)."""
    ranking = "chosen" in entry or "rejected" in entry  # a preference pair (LLaMA-Factory's ranking layout)
    if "messages" in entry:
        return DatasetFormat("", "", ranking=ranking,
                             columns=dict(SHAREGPT_COLUMNS, messages="messages", system="system"),
                             tags=dict(TAGS, role_tag="role", content_tag="content", user_tag="user",
                                       assistant_tag="assistant"))
    if "conversations" in entry:
        return DatasetFormat("", "", ranking=ranking, columns=dict(SHAREGPT_COLUMNS, system="system"))
    raise BadSample(source, "no 'messages' or 'conversations' list")


def _message_turns(entry: dict, fmt: DatasetFormat, source: str) -> Tuple[Optional[str], list]:
    """(system, turns) of a sharegpt-formatted entry under ``fmt``'s columns and tags."""
    key, tags = fmt.columns["messages"], fmt.tags
    raw = entry.get(key)
    if not isinstance(raw, list):
        raise BadSample(source, f"'{key}' must be a list of messages, got {type(raw).__name__}")
    if not raw:
        raise BadSample(source, f"'{key}' is an empty list")
    roles = {tags["user_tag"]: "user", tags["assistant_tag"]: "assistant", tags["system_tag"]: "system"}
    if not fmt.name:  # told from the entry (no dataset_info.json): either layout's role names, as always
        roles.update(ROLES)
    tools = {tags["observation_tag"], tags["function_tag"]}
    system = entry.get(fmt.columns["system"]) if fmt.columns.get("system") else None
    system = system if isinstance(system, str) else None
    turns = []
    for number, message in enumerate(raw):
        if not isinstance(message, dict) or not isinstance(message.get(tags["content_tag"]), str):
            raise BadSample(source, f"message {number} has no text field {tags['content_tag']!r}")
        tag = message.get(tags["role_tag"])
        if tag in tools:
            raise BadSample(source, f"message {number} is a tool turn ({tag!r}): not supported")
        role = roles.get(tag)
        if role is None:
            raise BadSample(source, f"message {number} has role {tag!r}; expected one of {sorted(roles)}")
        if role == "system":
            if number:
                raise BadSample(source, "a system message may only come first")
            system = message[tags["content_tag"]]
            continue
        turns.append((role, message[tags["content_tag"]]))
    return system, turns


def _alpaca_turns(entry: dict, fmt: DatasetFormat, source: str) -> Tuple[Optional[str], list]:
    """(system, turns) of an alpaca entry: history pairs, then instruction + input -> output."""
    columns = fmt.columns
    turns = []
    history = entry.get(columns["history"]) if columns.get("history") else None
    for number, pair in enumerate(history or []):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise BadSample(source, f"history item {number} must be a [query, answer] pair")
        turns += [("user", _text(pair[0], source, "a history query")),
                  ("assistant", _text(pair[1], source, "a history answer"))]
    prompt = _text(entry.get(columns["prompt"]), source, f"'{columns['prompt']}'")
    query = entry.get(columns["query"]) or ""
    turns.append(("user", prompt + ("\n" + _text(query, source, f"'{columns['query']}'") if query else "")))
    if not fmt.ranking:
        turns.append(("assistant", _text(entry.get(columns["response"]), source, f"'{columns['response']}'")))
    system = entry.get(columns["system"]) if columns.get("system") else None
    return (system if isinstance(system, str) else None), turns


def _answer(value, fmt: DatasetFormat, source: str, what: str) -> str:
    """A ranking set's chosen / rejected answer: text (alpaca) or an assistant message (sharegpt;
    told from the entry, either layout's assistant name, or the text alone)."""
    if value is None:
        raise BadSample(source, f"'{what}' is missing: a preference pair needs a chosen and a rejected answer")
    if fmt.formatting == "sharegpt" and not (isinstance(value, str) and not fmt.name):
        assistant = {fmt.tags["assistant_tag"]} | ({"assistant", "gpt"} if not fmt.name else set())
        if not isinstance(value, dict) or value.get(fmt.tags["role_tag"]) not in assistant:
            raise BadSample(source, f"'{what}' must be an assistant message")
        value = value.get(fmt.tags["content_tag"])
    return _text(value, source, f"'{what}'")


def parse_entry(entry, source: str, media_dir: str = "", fmt: Optional[DatasetFormat] = None,
                prompts: bool = False) -> Conversation:
    """One LLaMA-Factory entry as a checked `Conversation`; ``fmt`` the data set's layout from a
    dataset_info.json (default: told from the entry); with ``prompts`` a prompt and its reference
    answer (mm_data.vl.prompts)."""
    if not isinstance(entry, dict):
        raise BadSample(source, f"expected an object, got {type(entry).__name__}")
    fmt = fmt or _detected(entry, source)
    reader = _alpaca_turns if fmt.formatting == "alpaca" else _message_turns
    system, turns = reader(entry, fmt, source)
    if prompts:
        return _with_media(entry, fmt, source, media_dir, system, *_prompt_turns(entry, fmt, turns, source))
    rejected = None
    if fmt.ranking:
        turns.append(("assistant", _answer(entry.get(fmt.columns["chosen"]), fmt, source, fmt.columns["chosen"])))
        rejected = _answer(entry.get(fmt.columns["rejected"]), fmt, source, fmt.columns["rejected"])
        if rejected == turns[-1][1]:
            raise BadSample(source, "the chosen and the rejected answers are the same: the pair teaches nothing")
    _check_turns(turns, "assistant", source)
    return _with_media(entry, fmt, source, media_dir, system, turns, rejected)


def _check_turns(turns, last: str, source: str) -> None:
    expected = ["user", "assistant"] * (len(turns) // 2 + 1)
    if not turns or [role for role, _ in turns] != expected[:len(turns)] or turns[-1][0] != last:
        raise BadSample(source, f"turns must alternate user / assistant and end with the {last}, got "
                                f"{[role for role, _ in turns]}")


def _prompt_turns(entry: dict, fmt: DatasetFormat, turns: list, source: str):
    """(the prompt's turns, None, its reference answer): the turns to the last user turn; the
    answer from ``solution``, else the assistant's answer that ended the turns."""
    if fmt.ranking:
        raise BadSample(source, "a preference pair is not a prompt: GRPO reads prompts with a solution")
    solution = entry.get("solution")
    if turns and turns[-1][0] == "assistant":
        answer = turns.pop()[1]
        solution = answer if solution is None else solution
    if solution is not None and (isinstance(solution, bool) or not isinstance(solution, (str, int, float))):
        raise BadSample(source, f"'solution' must be text or a number, got {type(solution).__name__}")
    _check_turns(turns, "user", source)
    return turns, None, None if solution is None else str(solution)


def _with_media(entry: dict, fmt: DatasetFormat, source: str, media_dir: str, system, turns, rejected,
                solution: Optional[str] = None) -> Conversation:
    """The `Conversation` with its media paths, checked against the placeholders of its turns."""
    media = {}
    for key, placeholder in PLACEHOLDERS.items():
        column = fmt.columns.get(key) or key
        paths = entry.get(column) or []
        paths = [paths] if isinstance(paths, (str, bytes)) else paths
        if not isinstance(paths, list) or not all(isinstance(p, (str, bytes)) for p in paths):
            raise BadSample(source, f"'{column}' must be a list of paths (or of the files' bytes, in a shard)")
        count = sum(text.count(placeholder) for _, text in turns) + (system or "").count(placeholder)
        if count != len(paths):
            raise BadSample(source, f"{count} {placeholder} placeholders but {len(paths)} {key}")
        media[key] = tuple(p if isinstance(p, bytes) or os.path.isabs(p) or "://" in p else os.path.join(media_dir, p)
                           for p in paths)
    return Conversation(tuple(turns), system, media["images"], media["videos"], media["audios"], source, rejected,
                        solution, media_info(entry, source))


def read_conversations(path: str, media_dir: Optional[str] = None, log: Optional[BadInputLog] = None,
                       fmt: Optional[DatasetFormat] = None, prompts: bool = False) -> List[Conversation]:
    """Every usable conversation of a LLaMA-Factory JSON / JSONL file (``fmt``: its layout from a
    dataset_info.json, else told per entry; ``prompts``: prompts with their reference answers);
    bad entries go to ``log``."""
    log = log if log is not None else BadInputLog()
    media_dir = media_dir if media_dir is not None else os.path.dirname(os.path.abspath(path))
    before = log.count
    entries = json_entries(path, log)
    malformed = log.count - before
    conversations = parse_all(entries, lambda entry, source: parse_entry(entry, source, media_dir, fmt, prompts), log)
    log.total = (log.total or 0) + len(entries) + malformed
    log.check()
    return conversations


def shard_conversations(shards: ShardSet, media_dir: Optional[str] = None, fmt: Optional[DatasetFormat] = None,
                        prompts: bool = False) -> ShardEntries:
    """The conversations of a set of shards, each parsed when its sample is read (a bad row is a
    `BadSample` then); media paths start at ``media_dir`` or the row's shard folder."""
    return ShardEntries(shards, lambda entry, source, folder: parse_entry(entry, source, media_dir or folder, fmt,
                                                                          prompts))


def read_datasets(formats: Sequence[DatasetFormat], media_dir: Optional[str] = None,
                  log: Optional[BadInputLog] = None, seed: int = 0, prompts: bool = False) -> List[Conversation]:
    """The conversations of dataset_info.json's data sets (``num_samples`` keeps a set's first
    ones): one after the other, or mixed by their ratios (`mix`); media paths start at
    ``media_dir`` or each set's folder."""
    sets = []
    for fmt in formats:
        read = read_conversations(fmt.path, media_dir, log, fmt, prompts)
        sets.append(read[:fmt.num_samples] if fmt.num_samples else read)
    if formats and formats[0].ratio is not None:
        return mix(sets, [fmt.ratio for fmt in formats], seed)
    return [c for read in sets for c in read]


def mix(sets: Sequence[Sequence[Conversation]], ratios: Sequence[float], seed: int = 0) -> List[Conversation]:
    """LLaMA-Factory's interleave_under (datasets.interleave_datasets with these probabilities and
    stopping_strategy "first_exhausted"): draw a set by its ratio, take its next conversation,
    stop when a drawn set has none left. Deterministic from ``seed``."""
    rng = np.random.default_rng(seed)
    taken, out = [0] * len(sets), []
    while True:
        which = int(rng.choice(len(sets), p=np.asarray(ratios, float) / sum(ratios)))
        if taken[which] == len(sets[which]):
            return out
        out.append(sets[which][taken[which]])
        taken[which] += 1
