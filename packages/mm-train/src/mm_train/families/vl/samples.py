"""VL samples: greedy answers to fixed prompts (with their pictures), written as a Markdown page.

Each prompt of ``eval.prompts`` is one user turn (with ``eval.images`` / ``eval.videos`` /
``eval.audios``: its picture / clip / sound, an ``<image>`` / ``<video>`` / ``<audio>``
placeholder put in front unless the prompt places it), encoded by the run's chat template and
processors exactly as training data is (the family's data set: `mm_data.vl.VLSFTDataset`, or
`OmniSFTDataset` for Qwen2.5-Omni), ending in the assistant's header; the model continues it
greedily for up to ``eval.max_new_tokens`` tokens. Rank 0 writes ``answers.md`` with each
picture / clip / sound copied beside it.

One decoder under every layout: `mm_parallel.decoding` (a key / value cache on each pipeline
stage, the sequence whole under cp / sp, the tokens chosen on the last stage and broadcast),
greedy, the same answer on every rank.
"""

from __future__ import annotations

import os
import shutil
from typing import Dict, List, Optional, Sequence

import numpy as np

# Deferred imports: MindSpore and mm-parallel (the CLI starts without loading MindSpore); mm-data (optional: a
# missing one is named when a run needs it).

PLACEHOLDERS = {"images": "<image>", "videos": "<video>", "audios": "<audio>"}


def with_placeholders(prompt: str, media: Dict[str, Sequence[str]]) -> str:
    """The prompt with an ``<image>`` / ``<video>`` / ``<audio>`` in front for each picture / clip /
    sound it does not place itself; a prompt placing more than it is given is an error."""
    for kind, mark in PLACEHOLDERS.items():
        given, placed = len(media.get(kind, ())), prompt.count(mark)
        if placed > given:
            raise ValueError(f"the prompt {prompt!r} has {placed} {mark} placeholders for {given} {kind}: give one "
                             f"(--{kind[:-1]} / eval.{kind}) per placeholder")
        prompt = mark * (given - placed) + prompt
    return prompt


def prompt_inputs(tokenizer, processors, system: Optional[str], prompt: str, media: Dict[str, Sequence[str]],
                  dataset_class: type) -> Dict[str, np.ndarray]:
    """The forward keywords of one prompt with its ``media`` ({"images": [...], "videos": [...],
    "audios": [...]}) as a batch of one, as the data set ``dataset_class`` (an mm_data.vl data set) with
    this tokenizer, these (image, video) processors and this default system turn encodes a user turn."""
    from mm_data import BadSample
    from mm_data.vl.conversation import Conversation

    prompt = with_placeholders(prompt, media)
    conversation = Conversation(turns=(("user", prompt),), source=prompt,
                                **{kind: tuple(media.get(kind, ())) for kind in PLACEHOLDERS})
    dataset = dataset_class([conversation], tokenizer, *processors, default_system=system)
    try:
        sample = dataset.get(0)
    except BadSample as error:  # e.g. a picture or a clip that cannot be read
        raise ValueError(f"the prompt cannot be encoded: {error.source}: {error.reason}") from None
    batch = dataset.collator()([sample])
    batch.pop("labels", None)
    return batch


def answer(chunks, topo, tokenizer, processors, system: Optional[str], prompt: str, media: Dict[str, Sequence[str]],
           max_new_tokens: int, dataset_class: type) -> str:
    """The model's greedy answer to one prompt (with its pictures / clips / sounds) under this layout."""
    from mm_parallel.decoding import decode, end_tokens

    inputs = prompt_inputs(tokenizer, processors, system, prompt, media, dataset_class)
    out = decode(chunks, inputs, max_new_tokens, stop_tokens=end_tokens(chunks[-1].config),
                 pad_id=tokenizer.pad_token_id or 0, topology=topo)
    return tokenizer.decode(out.tokens[0, :out.lengths[0]].tolist(), skip_special_tokens=True).strip()


def write_answers(task, chunks, prompts: List[str], media_files: Dict[str, List[str]], max_new_tokens: int,
                  out: str, writer: bool) -> Dict:
    """answers.md under ``out`` (``writer``: this rank writes), each prompt's picture, clip or sound
    ({"images": [one per prompt or ""], "videos": ..., "audios": ...}) copied beside it; {"files": [...]}."""
    lines, files = ["# Answers", ""], []
    processors = task.processors(task.recipe.data)
    for index, prompt in enumerate(prompts):
        media = {kind: [paths[index]] if paths and paths[index] else []  # "": this prompt has none
                 for kind, paths in media_files.items()}
        text = answer(chunks, task.topo, task.tokenizer, processors, task.recipe.data.system, prompt, media,
                      max_new_tokens, task.dataset_class())
        lines += [f"## {index}. {prompt}", ""]
        for kind, path in ((k, p) for k, paths in media.items() for p in paths):
            copy = f"{kind[:-1]}_{index}{os.path.splitext(path)[1]}"
            if writer:
                shutil.copyfile(path, os.path.join(out, copy))
                files.append(os.path.join(out, copy))
            lines += [f"![{os.path.basename(path)}]({copy})" if kind == "images" else f"[{os.path.basename(path)}]"
                      f"({copy})", ""]
        lines += ["> " + (text.replace("\n", "\n> ") or "(no answer)"), ""]
    if writer:
        with open(os.path.join(out, "answers.md"), "w") as f:
            f.write("\n".join(lines))
        files.append(os.path.join(out, "answers.md"))
    return {"files": files}
