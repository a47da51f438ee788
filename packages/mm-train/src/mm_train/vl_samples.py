"""VL samples: greedy answers to fixed prompts (with their pictures), written as a Markdown page.

Each prompt of ``eval.prompts`` is one user turn (with ``eval.images``: its picture, an
``<image>`` placeholder put in front unless the prompt places it), encoded by the run's chat
template and processors exactly as training data is (`mm_data.vl.VLSFTDataset`), ending in the
assistant's header; the model continues it greedily for up to ``eval.max_new_tokens`` tokens
(`generate`: a key / value cache, transformers' greedy search). Rank 0 writes
``answers.md`` with each picture copied beside it. Greedy decoding with a cache runs the whole
model on every rank: tp (logits gathered over the vocabulary) and dp; not pp, cp or sequence
parallelism, whose one-token steps do not cut into their parts (`check` refuses them early).
"""

from __future__ import annotations

import os
import shutil
from typing import Dict, List, Optional

import numpy as np

IMAGE = "<image>"


def check(recipe) -> None:
    """The layouts greedy decoding runs under (module docstring)."""
    par = recipe.parallel
    if par.pp > 1 or par.cp > 1 or par.sequence_parallel:
        raise ValueError("eval.sample_every for a VL model decodes with a key / value cache, which runs under tp and "
                         "dp only; set eval.sample_every=0 under pp, cp or sequence parallelism (eval.every's "
                         "validation loss runs under every layout) or answer afterwards with mm-train generate")


def prompt_inputs(tokenizer, processors, system: Optional[str], prompt: str,
                  image: Optional[str]) -> Dict[str, np.ndarray]:
    """The forward keywords of one prompt (a batch of one), as a data set with this tokenizer, these
    (image, video) processors and this default system turn encodes a user turn."""
    from mm_data import BadSample
    from mm_data.vl import VLSFTDataset
    from mm_data.vl.conversation import Conversation

    if image and IMAGE not in prompt:
        prompt = IMAGE + prompt
    if prompt.count(IMAGE) != (1 if image else 0):
        raise ValueError(f"the prompt {prompt!r} has {prompt.count(IMAGE)} {IMAGE} placeholders for "
                         f"{1 if image else 0} pictures: give one picture (--image / eval.images) per placeholder")
    conversation = Conversation(turns=(("user", prompt),), images=(image,) if image else (), source=prompt)
    dataset = VLSFTDataset([conversation], tokenizer, *processors, default_system=system)
    try:
        sample = dataset.get(0)
    except BadSample as error:  # e.g. a picture that cannot be read
        raise ValueError(f"the prompt cannot be encoded: {error.source}: {error.reason}") from None
    batch = dataset.collator()([sample])
    batch.pop("labels", None)
    return batch


def answer(model, tokenizer, processors, system: Optional[str], prompt: str, image: Optional[str],
           max_new_tokens: int) -> str:
    """The model's greedy answer to one prompt (with its picture)."""
    inputs = prompt_inputs(tokenizer, processors, system, prompt, image)
    ids = inputs.pop("input_ids")
    tokens = model.generate(ids, max_new_tokens=max_new_tokens, **inputs)
    return tokenizer.decode(tokens[0, ids.shape[1]:].tolist(), skip_special_tokens=True).strip()


def write_answers(task, model, prompts: List[str], images: List[str], max_new_tokens: int, out: str,
                  writer: bool) -> Dict:
    """answers.md under ``out`` (``writer``: this rank writes); {"files": [...]}."""
    lines = ["# Answers", ""]
    files = []
    for index, prompt in enumerate(prompts):
        image = images[index] if images else None
        text = answer(model, task.tokenizer, task.processors(task.recipe.data), task.recipe.data.system, prompt,
                      image, max_new_tokens)
        lines += [f"## {index}. {prompt}", ""]
        if image and writer:
            copy = f"image_{index}{os.path.splitext(image)[1]}"
            shutil.copyfile(image, os.path.join(out, copy))
            files.append(os.path.join(out, copy))
            lines += [f"![{os.path.basename(image)}]({copy})", ""]
        lines += ["> " + (text.replace("\n", "\n> ") or "(no answer)"), ""]
    if writer:
        with open(os.path.join(out, "answers.md"), "w") as f:
            f.write("\n".join(lines))
        files.append(os.path.join(out, "answers.md"))
    return {"files": files}
