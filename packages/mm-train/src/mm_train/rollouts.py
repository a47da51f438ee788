"""GRPO's rollouts: a rank's prompts completed in place by the training model, scored, as training rows.

For the prompts of one generation (a data-parallel rank's share of a step's prompts):

1. the prompts as one left-padded batch (the data set's collator, then `mm_data.vl.left_padded`;
   each prompt's media once), ``num_generations`` completions each from one prefill
   (mm_parallel.decoding under the training layout, in inference mode), sampled at the recipe's
   temperature / top-k / top-p, each row's draws keyed by (generation, prompt index, copy) — a
   resumed run, or another layout, draws what this one drew; the media placeholder tokens are
   never sampled (a completion's placeholder would ask the towers for media it has none of);
2. the completions' text (up to and with the stop token) scored by the reward functions
   (mm_train.rewards), with the prompt as messages and the sample's reference answer;
3. each completion as a training sequence: the prompt's tokens, then the completion's, which are
   its labels; a prompt's sequences grouped (they share its media: mm_data.vl.groups).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

import numpy as np

from mm_parallel.decoding import decode, end_tokens
from mm_train.samples import inference

# Deferred imports: mm-data (optional: a missing one is named when a run needs it).

TOKEN_ALIGNED = ("input_ids", "attention_mask", "mm_token_type_ids", "labels")
PLACEHOLDER_IDS = ("image_token_id", "video_token_id", "audio_token_id", "audio_token_index")


@dataclass
class Rollouts:
    """One generation's completions, prompt-major (row = prompt x num_generations + copy)."""

    groups: List[List[Dict]]  # per prompt its completions as training sequences (forward keywords, unpadded)
    rewards: np.ndarray  # (rows,) the weighted total (NaN: no function scored it)
    per_function: Dict[str, np.ndarray]  # (rows,) each reward function's (NaN: not scored)
    lengths: np.ndarray  # (rows,) completion tokens, the stop token included


def suppressed_tokens(config) -> List[int]:
    """The media placeholder ids of a model config (text config first): never sampled."""
    ids = []
    for holder in (config, getattr(config, "text_config", None)):
        ids += [getattr(holder, name) for name in PLACEHOLDER_IDS if isinstance(getattr(holder, name, None), int)]
    return sorted(set(ids))


def generate(task, chunks, topo, grpo, rewards, prompts: List[Dict], generation: int, seed: int) -> Rollouts:
    """The rollouts of ``prompts`` (the data set's prompt samples) for ``generation`` (module docstring)."""
    from mm_data.vl import PROMPT_INDEX, left_padded

    dataset, tokenizer, copies = task.dataset, task.tokenizer, grpo.num_generations
    indices = [int(p[PROMPT_INDEX]) for p in prompts]
    plain = [{k: v for k, v in p.items() if k != PROMPT_INDEX} for p in prompts]
    batch = left_padded(dataset.collator()(plain))
    config, pad = chunks[-1].config, tokenizer.pad_token_id or 0
    with inference(chunks):
        out = decode(chunks, batch, grpo.max_completion_length, grpo.sampling(), end_tokens(config), pad,
                     copies=copies, seed=seed, keys=[(generation, i, c) for i in indices for c in range(copies)],
                     topology=topo, suppress_tokens=suppressed_tokens(config))
    completions = [out.tokens[r, :out.lengths[r]] for r in range(len(out.tokens))]
    texts = [tokenizer.decode(ids.tolist(), skip_special_tokens=True) for ids in completions]
    repeat = lambda values: [v for v in values for _ in range(copies)]  # noqa: E731
    messages = [[{"role": role, "content": text} for role, text in dataset.conversations[i].turns] for i in indices]
    total, per_function = rewards.score(repeat(messages), texts, repeat([dataset.solution(i) for i in indices]),
                                        completions, repeat([dataset.source(i) for i in indices]))
    groups = [[sequence(prompt, completions[p * copies + c]) for c in range(copies)] for p, prompt in enumerate(plain)]
    return Rollouts(groups, total, per_function, out.lengths.copy())


def sequence(prompt: Dict, completion: np.ndarray) -> Dict:
    """A training sequence: the prompt sample's tokens and media, then the completion, its labels."""
    ids = np.asarray(prompt["input_ids"])
    completion = np.asarray(completion, ids.dtype)
    out = {k: v for k, v in prompt.items() if k not in TOKEN_ALIGNED}
    out["input_ids"] = np.concatenate([ids, completion])
    out["labels"] = np.concatenate([np.full(len(ids), -100, ids.dtype), completion])
    out["attention_mask"] = np.ones(len(out["input_ids"]), np.int64)
    if "mm_token_type_ids" in prompt:
        out["mm_token_type_ids"] = np.concatenate([prompt["mm_token_type_ids"], np.zeros(len(completion), np.int64)])
    return out
