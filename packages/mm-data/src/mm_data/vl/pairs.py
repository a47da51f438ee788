"""Preference pairs as training samples: a prompt with its media and two answers, kept together.

A pair sample is one sample of the data set (so a sampler, the data-parallel balance and the
packer never split it): the chosen sequence's fields as an SFT sample has them, plus
``rejected_input_ids`` / ``rejected_labels`` / ``rejected_mm_token_type_ids`` (the same prompt
with the rejected answer). Neither side is ever cut to ``max_length``: a cut answer's
log-probability would not be the answer's, so a longer side makes the pair a `BadSample`.

A micro-batch of P pairs is 2P sequences, the P chosen ones first, then the P rejected ones in
the same order (`unfold`), padded rows or the segments of one packed row alike: groups of two
sequences sharing their prompt's media (`mm_data.vl.groups`: the towers' inputs once,
``media_copies = 2``, the towers run once per pair and both sequences read the same features).
``answer_tokens`` counts each sequence's trained (answer) tokens, what IPO and RPO divide by;
``pair_index`` each pair's index in the data set.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional

import numpy as np

from mm_data.errors import BadSample
from mm_data.vl.conversation import Conversation
from mm_data.vl.groups import TOWER_INPUTS, collate_groups, copy_major
from mm_data.vl.packing import PackedRows

REJECTED = "rejected_"
TOKEN_FIELDS = ("input_ids", "labels", "mm_token_type_ids")
PAIR_INDEX = "pair_index"  # the data set's index of a pair sample (a reference cache's key)
PAIR_KEYS = ("media_copies", "answer_tokens", PAIR_INDEX)  # what `collate_pairs` adds to a micro-batch


def rejected_side(conversation: Conversation) -> Conversation:
    """The conversation with its rejected answer as the last assistant turn."""
    turns = conversation.turns[:-1] + (("assistant", conversation.rejected),)
    return dataclasses.replace(conversation, turns=turns, rejected=None)


def encode_pair(encode: Callable[[Conversation], Dict[str, np.ndarray]], conversation: Conversation,
                max_length: Optional[int]) -> Dict[str, np.ndarray]:
    """The pair sample's token fields: ``encode`` (the data set's template, uncut) of both sides."""
    chosen, rejected = encode(conversation), encode(rejected_side(conversation))
    for side, tokens in (("chosen", chosen), ("rejected", rejected)):
        if max_length is not None and len(tokens["input_ids"]) > max_length:
            count = len(tokens["input_ids"])
            raise BadSample(conversation.source, f"the {side} sequence has {count} tokens, more than max_length="
                                                 f"{max_length}; a pair is never cut (the answer's log-probability "
                                                 "would be a part's): raise data.max_length")
    return {**chosen, **{REJECTED + key: value for key, value in rejected.items()}}


def pair_length(tokens: Dict[str, np.ndarray]) -> int:
    """The tokens a pair sample takes in a micro-batch: both sequences."""
    return len(tokens["input_ids"]) + len(tokens.get(REJECTED + "input_ids", ()))


def sides(pair: Dict) -> List[Dict]:
    """A pair sample's [chosen, rejected] sequence samples; the rejected side without the towers'
    inputs (mm_data.vl.groups gives them once per group)."""
    chosen = {k: v for k, v in pair.items() if not k.startswith(REJECTED)}
    shared = {k: v for k, v in pair.items()
              if not k.startswith(REJECTED) and k not in TOWER_INPUTS + TOKEN_FIELDS + ("attention_mask",)}
    own = {k[len(REJECTED):]: v for k, v in pair.items() if k.startswith(REJECTED)}
    return [chosen, {**shared, **own, "attention_mask": np.ones_like(own["input_ids"])}]


def unfold(pairs: List[Dict]) -> List[Dict]:
    """P pair samples as 2P sequence samples: the chosen ones, then the rejected ones (module
    docstring; mm_data.vl.groups.copy_major)."""
    return copy_major([sides(p) for p in pairs])


def collate_pairs(collate: Callable, pairs: List[Dict], pack_rows: bool = False) -> Dict:
    """The pairs' sequences (`unfold`) ``collate``d — one packed row with ``pack_rows``, else
    padded rows — with `PAIR_KEYS`."""
    indices = np.array([int(p.get(PAIR_INDEX, -1)) for p in pairs], np.int64)
    groups = [sides({k: v for k, v in p.items() if k != PAIR_INDEX}) for p in pairs]
    batch = collate_groups(collate, groups, pack_rows)
    batch[PAIR_INDEX] = indices
    batch["answer_tokens"] = np.array([int((np.asarray(s["labels"]) != -100).sum()) for s in copy_major(groups)],
                                      np.int64)
    return batch


class PairCollate:
    """A micro-batch of pair samples: their 2P sequences padded into rows (`collate_pairs`)."""

    def __init__(self, collate: Callable):
        self.collate = collate

    def __call__(self, pairs: List[Dict]) -> Dict:
        return collate_pairs(self.collate, pairs)


class PairedRows(PackedRows):
    """`PackedRows` of pair samples: a pair's two sequences in one row (its length counts both),
    the row's chosen segments first, then its rejected ones."""

    @staticmethod
    def length(sample: Dict) -> int:
        return pair_length(sample)

    def row(self, samples: List[Dict]) -> Dict:
        return collate_pairs(self.collate, samples, pack_rows=True)
