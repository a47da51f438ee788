"""Prompts as samples (reinforcement learning: GRPO): a conversation up to its last user turn,
its media, and the reference answer the rewards compare with.

An entry is an SFT entry (LLaMA-Factory's messages / ShareGPT layouts, or dataset_info.json's
columns) whose turns end with the user's, with its reference answer beside the messages in a
``solution`` field (text or a number; R1-V's and open-r1's name), or whose turns end with an
assistant answer, which is then the reference answer and not part of the prompt. A sample is the
prompt's tokens up to the assistant's header (what the model continues), its media, and
``prompt_index`` (its index in the data set). A prompt is never cut: one longer than the data
set's ``max_length`` (the prompt budget: room left for the completion) is a `BadSample`, counted
and logged like any other.

`left_padded` turns the data set's collated (right-padded) prompts into the left-padded batch
decoding continues (mm_parallel.decoding): every token-aligned field's row rolled so that its
pads come first.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import numpy as np

from mm_data.errors import BadSample
from mm_data.vl.conversation import Conversation

PROMPT_INDEX = "prompt_index"  # the data set's index of a prompt sample


def encode_prompt(encode: Callable[[Conversation], Dict[str, np.ndarray]], conversation: Conversation,
                  max_length: Optional[int]) -> Dict[str, np.ndarray]:
    """The prompt's token fields (``encode``: the data set's template, uncut), without labels."""
    tokens = encode(conversation)
    if max_length is not None and len(tokens["input_ids"]) > max_length:
        raise BadSample(conversation.source, f"the prompt has {len(tokens['input_ids'])} tokens, more than the prompt "
                                             f"budget of {max_length}; a prompt is never cut: raise data.max_length "
                                             "or lower grpo.max_completion_length")
    tokens.pop("labels", None)
    return tokens


def left_padded(batch: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """A right-padded batch (``attention_mask`` ones then zeros) with each row's pads moved to its
    front in every field shaped as ``input_ids``; the other fields (media) as they are."""
    mask = np.asarray(batch["attention_mask"])
    shape, pads = mask.shape, (mask == 0).sum(1)
    out = dict(batch)
    for key, value in batch.items():
        if isinstance(value, np.ndarray) and value.shape == shape:
            out[key] = np.stack([np.roll(row, int(n)) for row, n in zip(value, pads)])
    return out
