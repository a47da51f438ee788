"""The Qwen2-VL / Qwen2.5-VL chat format (ChatML) with media expansion and assistant-only labels.

A conversation becomes

    <|im_start|>system\\n{system}<|im_end|>\\n
    <|im_start|>user\\n{user}<|im_end|>\\n<|im_start|>assistant\\n{assistant}<|im_end|>\\n   (per turn)

with every ``<image>`` replaced by ``<|vision_start|>`` + ``<|image_pad|>`` x n + ``<|vision_end|>``,
n = the image's patches / merge_size², and ``<video>`` likewise with ``<|video_pad|>`` (audio:
``<|audio_bos|>`` + ``<|AUDIO|>`` x n + ``<|audio_eos|>``, Qwen2.5-Omni). Labels are the token ids
of each assistant reply with its ``<|im_end|>\\n`` (every turn trains, as LLaMA-Factory's default),
-100 elsewhere. Text between placeholders is tokenised piece by piece and the media ids are
inserted directly; special tokens split a tokenizer's input anyway, so the ids equal tokenising
the expanded string whole (tested), without building strings of thousands of pad tokens.

Qwen2.5-Omni names the same ids differently (``media=OMNI_MEDIA``): ``<|vision_bos|>``,
``<|IMAGE|>`` / ``<|VIDEO|>``, ``<|vision_eos|>``, ``<|audio_bos|>`` ``<|AUDIO|>`` ``<|audio_eos|>``;
a video with its own audio (``video_runs``) is ``<|vision_bos|><|audio_bos|>`` then its video and
audio pads in the runs given (mm_data.vl.omni.video_audio_runs) then ``<|audio_eos|><|vision_eos|>``.
"""

from __future__ import annotations

import json
import re
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from mm_data.errors import BadSample
from mm_data.vl.conversation import Conversation

IGNORE_INDEX = -100
_PLACEHOLDER = re.compile(r"(<image>|<video>|<audio>)")
QWEN_MEDIA = {"<image>": ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
              "<video>": ("<|vision_start|>", "<|video_pad|>", "<|vision_end|>"),
              "<audio>": ("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>")}
OMNI_MEDIA = {"<image>": ("<|vision_bos|>", "<|IMAGE|>", "<|vision_eos|>"),
              "<video>": ("<|vision_bos|>", "<|VIDEO|>", "<|vision_eos|>"),
              "<audio>": ("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>")}
TOKEN_TYPES = {"<image>": 1, "<video>": 2}  # mm_token_type_ids of the pads: 0 text, 1 image, 2 video


class QwenChatTemplate:
    """See the module docstring. ``tokenizer``: a transformers tokenizer knowing Qwen's special tokens."""

    def __init__(self, tokenizer, default_system: Optional[str] = "You are a helpful assistant.",
                 media: Dict[str, Tuple[str, str, str]] = QWEN_MEDIA):
        self.tokenizer, self.default_system, self.media = tokenizer, default_system, media
        self.ids: Dict[str, int] = {}
        for token in {"<|im_start|>", "<|im_end|>"} | {t for group in media.values() for t in group}:
            token_id = tokenizer.convert_tokens_to_ids(token)
            if token_id is not None and token_id != getattr(tokenizer, "unk_token_id", None):
                self.ids[token] = token_id
        required = dict.fromkeys(("<|im_start|>", "<|im_end|>", *media["<image>"], *media["<video>"]))
        missing = [t for t in required if t not in self.ids]
        if missing:
            raise ValueError(f"the tokenizer lacks Qwen's special tokens {missing}; use the model's own tokenizer")

    def _text(self, text: str) -> List[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def _expand(self, text: str, counts: Dict[str, List[int]], used: Dict[str, int], source: str,
                timestamps: Sequence[Sequence[float]] = (), video_runs: Sequence = ()) -> List[int]:
        ids, pending = [], ""  # text is tokenised in the runs between special tokens, as a whole string is
        for piece in _PLACEHOLDER.split(text):
            if piece not in self.media:
                pending += piece
                continue
            start, pad, end = self.media[piece]
            if pad not in self.ids:
                raise BadSample(source, f"{piece} needs the token {pad}, which this tokenizer lacks")
            if piece == "<video>" and video_runs:  # Qwen2.5-Omni: the video interleaved with its audio
                ids += self._text(pending) + [self.ids[start]] + self._video_with_audio(video_runs[used[piece]], source)
                ids.append(self.ids[end])
                used[piece], pending = used[piece] + 1, ""
                continue
            n = counts[piece][used[piece]]
            seconds = timestamps[used[piece]] if piece == "<video>" and timestamps else None
            used[piece] += 1
            groups = [None] if seconds is None else list(seconds)  # Qwen3-VL: one group per temporal patch
            for t in groups:
                if t is not None:
                    pending += f"<{t:.1f} seconds>"
                ids += self._text(pending) + [self.ids[start]] + [self.ids[pad]] * (n // len(groups)) + [self.ids[end]]
                pending = ""
        return ids + self._text(pending)

    def _video_with_audio(self, runs, source: str) -> List[int]:
        """``<|audio_bos|>`` + the runs of video and audio pads + ``<|audio_eos|>``."""
        audio_start, audio_pad, audio_end = self.media["<audio>"]
        if audio_pad not in self.ids:
            raise BadSample(source, f"a video with its audio needs the token {audio_pad}, which this tokenizer lacks")
        pads = {"video": self.ids[self.media["<video>"][1]], "audio": self.ids[audio_pad]}
        return [self.ids[audio_start]] + [pads[kind] for kind, n in runs for _ in range(n)] + [self.ids[audio_end]]

    def encode(self, conversation: Conversation, image_tokens: Sequence[int] = (), video_tokens: Sequence[int] = (),
               audio_tokens: Sequence[int] = (), max_length: Optional[int] = None,
               video_timestamps: Sequence[Sequence[float]] = (), video_runs: Sequence = ()) -> Dict[str, np.ndarray]:
        """``input_ids``, ``labels`` and ``mm_token_type_ids`` of ``conversation``; ``*_tokens`` is the
        number of pad tokens of each image / video / audio, in placeholder order. With
        ``video_timestamps`` (Qwen3-VL: the seconds of each video's temporal patches) a video is one
        ``<t seconds><|vision_start|>pads<|vision_end|>`` group per temporal patch. With
        ``video_runs`` (Qwen2.5-Omni, a video with its audio) video i is its ("video" | "audio",
        count) runs, and its audio is not an ``<audio>`` placeholder of the text."""
        counts = {"<image>": list(image_tokens), "<video>": list(video_tokens), "<audio>": list(audio_tokens)}
        used = {key: 0 for key in counts}
        start, end, newline = self.ids["<|im_start|>"], self.ids["<|im_end|>"], self._text("\n")
        ids: List[int] = []
        labels: List[int] = []

        def add(tokens: List[int], trained: bool):
            ids.extend(tokens)
            labels.extend(tokens if trained else [IGNORE_INDEX] * len(tokens))

        system = conversation.system if conversation.system is not None else self.default_system
        source = conversation.source

        def expand(text: str) -> List[int]:
            return self._expand(text, counts, used, source, video_timestamps, video_runs)

        if system:  # None or "": no system turn
            add([start] + self._text("system\n") + expand(system) + [end] + newline, False)
        for role, text in conversation.turns:
            if role == "user":
                add([start] + self._text("user\n") + expand(text) + [end] + newline + [start]
                    + self._text("assistant\n"), False)
            else:
                add(expand(text) + [end] + newline, True)
        if video_runs:
            counts["<video>"] = list(video_runs)
        for key, values in counts.items():
            if used[key] != len(values):
                raise BadSample(source, f"{used[key]} {key} placeholders but {len(values)} media token counts")
        if max_length is not None and len(ids) > max_length:
            media = {self.ids[pad] for _, pad, _ in self.media.values() if pad in self.ids}
            if any(token in media for token in ids[max_length:]):
                raise BadSample(source, f"{len(ids)} tokens, more than max_length={max_length}, and the cut would "
                                        f"split its media; raise max_length or lower the media resolution")
            ids, labels = ids[:max_length], labels[:max_length]
        types = np.zeros(len(ids), np.int64)
        for piece, kind in TOKEN_TYPES.items():
            types[np.asarray(ids) == self.ids[self.media[piece][1]]] = kind
        return {"input_ids": np.asarray(ids, np.int64), "labels": np.asarray(labels, np.int64),
                "mm_token_type_ids": types}

    def jinja(self) -> str:
        """This format as a Hugging Face chat template (tokenizer_config's ``chat_template``), for
        messages whose content is a string or a list of {"type": "text" | "image" | "video" |
        "audio"} items: each medium is written as its start, one pad and its end token (e.g.
        ``<|vision_start|><|image_pad|><|vision_end|>``; the processor expands the pad to the
        medium's tokens, as transformers' Qwen processors do), the default system turn is this
        template's, ``add_generation_prompt`` opens the assistant turn. Tokenised after that
        expansion it gives `encode`'s ids (tested)."""
        system = json.dumps(self.default_system or "")
        media = "".join(f'{{%- elif item.type == "{kind}" or "{kind}" in item -%}}' + "".join(self.media[f"<{kind}>"])
                        for kind in ("image", "video", "audio") if self.media[f"<{kind}>"][1] in self.ids)
        return (f"{{%- set default_system = {system} -%}}"
                '{%- if messages and messages[0].role != "system" and default_system -%}'
                "<|im_start|>system{{ '\\n' }}{{ default_system }}<|im_end|>{{ '\\n' }}{%- endif -%}"
                "{%- for message in messages -%}"
                "<|im_start|>{{ message.role }}{{ '\\n' }}"
                "{%- if message.content is string -%}{{ message.content }}"
                "{%- else -%}{%- for item in message.content -%}"
                '{%- if item.type == "text" -%}{{ item.text }}' + media +
                "{%- endif -%}{%- endfor -%}{%- endif -%}"
                "<|im_end|>{{ '\\n' }}"
                "{%- endfor -%}"
                "{%- if add_generation_prompt -%}<|im_start|>assistant{{ '\\n' }}{%- endif -%}")

    def render(self, conversation: Conversation, image_tokens: Sequence[int] = (),
               video_tokens: Sequence[int] = ()) -> str:
        """The expanded prompt as text (for reading and for checks)."""
        return self.tokenizer.decode(self.encode(conversation, image_tokens, video_tokens)["input_ids"])
