"""VL samples: greedy answers to fixed prompts (with their pictures), written as a Markdown page.

Each prompt of ``eval.prompts`` is one user turn (with ``eval.images`` / ``eval.videos`` /
``eval.audios``: its picture / clip / sound, an ``<image>`` / ``<video>`` / ``<audio>``
placeholder put in front unless the prompt places it), encoded by the run's chat template and
processors exactly as training data is (the family's data set: `mm_data.vl.VLSFTDataset`, or
`OmniSFTDataset` for Qwen2.5-Omni), ending in the assistant's header; the model continues it
greedily for up to ``eval.max_new_tokens`` tokens. Rank 0 writes ``answers.md`` with each
picture / clip / sound copied beside it.

Two decoders, one answer: where the whole model runs on every rank with whole sequences (tp, dp)
the model's `generate` (a key / value cache, transformers' greedy search); under pp, cp or
sequence parallelism, whose one-token steps do not cut into their parts, `greedy_by_reforward`:
each new token from a whole forward pass over the sequence so far, right-padded to a length the
layout can cut (its mask marks the pads; causal attention keeps them from the real tokens), through the pipeline
stages (`mm_parallel.pipeline.forward_only`), the logits at the last real token gathered over
cp and the vocabulary, the token chosen on the last stage and broadcast. It costs one forward
pass of the whole sequence per token — affordable every so many steps — and gives the
cache's tokens (the positions of a new token are the last one's + 1 on every M-RoPE axis either
way; tested under pp2, cp2 and tp2 against one process).
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


def _cache_decodes(topo) -> bool:
    """Whether the model's cached `generate` runs under this layout (whole model and sequence)."""
    return topo.pp.size == 1 and topo.cp.size == 1 and not (topo.config.sequence_parallel and topo.tp.size > 1)


def _last_logits(y, position: int, topo) -> np.ndarray:
    """The last stage's logits (split over cp along the sequence, over tp along the vocabulary)
    at ``position`` of the whole sequence, whole."""
    from mm_parallel import comm
    from mm_parallel.context_parallel import gather_sequence

    logits = y["logits"] if isinstance(y, dict) else y
    if topo.cp.size > 1:
        logits = gather_sequence(logits, 1, topo)
    if topo.tp.size > 1:
        logits = comm.all_gather(logits[:, position:position + 1], topo.tp, -1)
        position = 0
    return logits[0, position].asnumpy()


def greedy_by_reforward(chunks, topo, inputs: Dict, max_new_tokens: int, eos, pad_id: int) -> np.ndarray:
    """Greedy tokens after ``inputs`` (a batch of one) by a whole forward pass per token (module
    docstring); the same on every rank."""
    import mindspore as ms

    from mm_parallel import comm, pipeline

    par = topo.config
    multiple = (2 * topo.cp.size if topo.cp.size > 1 else 1) * (topo.tp.size if par.sequence_parallel else 1)
    ids, types, new = inputs["input_ids"], inputs.get("mm_token_type_ids"), []
    media = {k: v for k, v in inputs.items() if k not in ("input_ids", "mm_token_type_ids", "attention_mask")}
    for _ in range(max_new_tokens):
        length = ids.shape[1]
        pad = -length % multiple
        batch = {**media, "input_ids": np.pad(ids, ((0, 0), (0, pad)), constant_values=pad_id),
                 "attention_mask": np.pad(np.ones_like(ids), ((0, 0), (0, pad)))}  # the positions read it
        if types is not None:
            batch["mm_token_type_ids"] = np.pad(types, ((0, 0), (0, pad)))
        picked = pipeline.forward_only([c.pipeline_stage for c in chunks], [(batch, batch)],
                                       lambda y, b: int(_last_logits(y, length - 1, topo).argmax()), topo,
                                       with_batch=True)
        token = ms.Tensor(np.array([picked[0] if picked else 0], np.int32))
        token = int(comm.broadcast(token, topo.pp.ranks[-1], topo.pp).asnumpy()[0])
        new.append(token)
        if token in eos:
            break
        ids = np.concatenate([ids, [[token]]], 1)
        if types is not None:
            types = np.concatenate([types, [[0]]], 1)
    return np.asarray(new, np.int64)


def answer(chunks, topo, tokenizer, processors, system: Optional[str], prompt: str, media: Dict[str, Sequence[str]],
           max_new_tokens: int, dataset_class: type) -> str:
    """The model's greedy answer to one prompt (with its pictures / clips / sounds) under this layout."""
    inputs = prompt_inputs(tokenizer, processors, system, prompt, media, dataset_class)
    ids = inputs["input_ids"]
    if _cache_decodes(topo):
        rest = {k: v for k, v in inputs.items() if k != "input_ids"}
        new = chunks[0].generate(ids, max_new_tokens=max_new_tokens, **rest)[0, ids.shape[1]:]
    else:  # the end tokens generate stops at
        config = chunks[-1].config
        eos = getattr(config.text_config, "eos_token_id", None) or getattr(config, "eos_token_id", None)
        eos = set(np.atleast_1d(eos).tolist()) if eos is not None else set()
        new = greedy_by_reforward(chunks, topo, inputs, max_new_tokens, eos, tokenizer.pad_token_id or 0)
    return tokenizer.decode(new.tolist(), skip_special_tokens=True).strip()


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
