"""GRPO's reward functions: the built-ins and the user's, by name, weighted into one reward.

A reward function scores a batch of completions, as trl's reward functions do:

    fn(prompts=[messages], completions=[[{"role": "assistant", "content": text}]],
       solution=[reference answer or None], completion_ids=[[token ids]], **columns) -> [number or None]

(conversational completions, the sample's columns as keywords), so the functions written for
trl / open-r1 / R1-V run unchanged. None marks a completion the function does not score (trl's
NaN: left out of that function's mean; a completion no function scores has no advantage).
Built-ins:

    accuracy   1 when the completion's answer — the text in its last <answer> ... </answer>, else
               the whole completion — equals the sample's ``solution`` after normalising both
               (case, spaces, surrounding quotes and end punctuation, a \\boxed{...} unwrapped);
               numbers compared as numbers (1,000 = 1000.0; 50% = 50); else 0. None without a
               solution.
    format     1 when the whole completion matches ``pattern`` (default: <think> ... </think>
               <answer> ... </answer>, R1's), else 0.

A user function is named "module:function" (imported from the Python path; nothing is fetched).
The reward is sum_k weight_k r_k over the functions that scored the completion. A function that
raises, or returns something other than one number or None per completion, stops the run with
its name and the sample's source.
"""

from __future__ import annotations

import importlib
import math
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import numpy as np

FORMAT_PATTERN = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\{(.*)\}", re.DOTALL)
_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")


def answer_of(completion: str) -> str:
    """The completion's answer: its last <answer> ... </answer>, else the whole text."""
    found = _ANSWER.findall(completion)
    return found[-1] if found else completion


def normalised(text: str) -> str:
    """Lower case, single spaces, no surrounding quotes or end punctuation, a \\boxed{} unwrapped."""
    boxed = _BOXED.search(text)
    text = boxed.group(1) if boxed else text
    text = " ".join(text.strip().lower().split())
    return text.strip("\"'`").rstrip(".!?;:,").strip()


def as_number(text: str) -> Optional[float]:
    """The number a normalised answer states (thousands commas, a trailing %, $ in front allowed), or None."""
    text = text.replace(",", "").lstrip("$").rstrip("%").strip()
    return float(text) if _NUMBER.match(text) else None


def same_answer(answer: str, solution: str) -> bool:
    a, b = normalised(answer), normalised(solution)
    x, y = as_number(a), as_number(b)
    if x is not None and y is not None:
        return math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9)
    return a == b


def accuracy(completions, solution, **_) -> List[Optional[float]]:
    """The built-in accuracy reward (module docstring)."""
    return [None if ref is None else float(same_answer(answer_of(_text(c)), str(ref)))
            for c, ref in zip(completions, solution)]


def format_reward(pattern: str = FORMAT_PATTERN) -> Callable:
    """The built-in format reward for ``pattern`` (matched against the whole completion)."""
    compiled = re.compile(pattern, re.DOTALL)

    def format(completions, **_) -> List[float]:  # noqa: A001 (the reward's name in metrics)
        return [float(compiled.fullmatch(_text(c)) is not None) for c in completions]

    return format


def _text(completion) -> str:
    """A completion's text: a string, or trl's conversational [{"role": "assistant", "content": ...}]."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def resolve(name: str, format_pattern: str = FORMAT_PATTERN) -> Callable:
    """The reward function a recipe names: accuracy, format, or "module:function"."""
    if name == "accuracy":
        return accuracy
    if name == "format":
        return format_reward(format_pattern)
    if ":" not in name:
        raise ValueError(f"grpo.rewards: {name!r} is not a reward function; use accuracy, format or "
                         "'module:function' (a function on the Python path)")
    module, attribute = name.split(":", 1)
    try:
        fn = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"grpo.rewards: cannot load {name!r} ({error}); put its module on PYTHONPATH") from None
    if not callable(fn):
        raise ValueError(f"grpo.rewards: {name!r} is not a function")
    return fn


@dataclass
class Rewards:
    """The weighted reward functions of a run; ``score`` gives each function's and the total."""

    functions: Dict[str, Callable]
    weights: Dict[str, float]

    @classmethod
    def from_recipe(cls, weights: Mapping[str, float], format_pattern: str = FORMAT_PATTERN) -> "Rewards":
        if not weights:
            raise ValueError("grpo.rewards names no reward function; e.g. {accuracy: 1.0, format: 0.5}")
        return cls({name: resolve(name, format_pattern) for name in weights}, {k: float(v) for k, v in weights.items()})

    def score(self, prompts: Sequence, completions: Sequence[str], solutions: Sequence, completion_ids: Sequence,
              sources: Sequence[str], columns: Optional[Mapping[str, Sequence]] = None):
        """(total (N,), {name: (N,) with NaN where not scored}) float64 for N completions."""
        conversational = [[{"role": "assistant", "content": text}] for text in completions]
        per_function = {}
        for name, fn in self.functions.items():
            try:
                values = fn(prompts=list(prompts), completions=conversational, solution=list(solutions),
                            completion_ids=[list(map(int, ids)) for ids in completion_ids], **dict(columns or {}))
            except Exception as error:
                raise RuntimeError(f"reward function {name!r} raised {type(error).__name__}: {error} (on the "
                                   f"completions of {_named(sources)})") from error
            per_function[name] = _checked(name, values, sources)
        scored = np.stack(list(per_function.values()), 1)
        weights = np.array([self.weights[name] for name in per_function])
        total = np.nansum(scored * weights, 1)
        total[np.isnan(scored).all(1)] = np.nan
        return total, per_function


def _checked(name: str, values, sources: Sequence[str]) -> np.ndarray:
    if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != len(sources):
        raise RuntimeError(f"reward function {name!r} returned {type(values).__name__} "
                           f"{'of ' + str(len(values)) + ' values ' if hasattr(values, '__len__') else ''}for "
                           f"{len(sources)} completions; it must return one number (or None) per completion")
    out = np.empty(len(values), np.float64)
    for i, value in enumerate(values):
        if value is None:
            out[i] = np.nan
        elif isinstance(value, (bool, int, float, np.number)) and not isinstance(value, complex) and \
                np.isfinite(float(value)):
            out[i] = float(value)
        else:
            raise RuntimeError(f"reward function {name!r} returned {value!r} for a completion of {sources[i]}; it "
                               "must return a finite number or None")
    return out


def _named(sources: Sequence[str]) -> str:
    unique = list(dict.fromkeys(sources))
    return ", ".join(unique[:3]) + (f" and {len(unique) - 3} more" if len(unique) > 3 else "")
