"""The recipe sections of the post-training objectives, and which objective a recipe may train.

    dpo:   method, beta, label_smoothing, sft_weight, reference — train.objective dpo
           (preference pairs: mm_train.preference_step, mm_parallel.preference)
    grpo:  num_generations, temperature, top_p, top_k, max_completion_length, rewards,
           format_pattern, scale_rewards, epsilon, epsilon_high, beta, reference, num_iterations —
           train.objective grpo (rollouts and rewards: mm_train.grpo_step, mm_parallel.grpo)

A section belongs to its objective: given for another it is refused, and `Recipe.to_dict` leaves
it out (it is no part of that run).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, Optional

# Deferred imports: mm-parallel (the CLI starts without loading MindSpore).

EXPONENT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")  # YAML 1.1 reads 1e3 (no dot) as a string
SCALE_REWARDS = ("group", "batch", "none")
GRPO_REFERENCES = ("copy", "adapters_off")


DPO_REFERENCES = ("copy", "adapters_off", "cached")


@dataclass
class DpoSection:
    """dpo: the preference objective of train.objective dpo (mm_parallel.preference): ``method``
    sigmoid (DPO) | ipo | hinge, ``beta`` (unset: 0.1 on answers' log-probs, 2500 on clips'
    denoising errors — Diffusion-DPO, the timesteps' factor inside), ``label_smoothing``
    (sigmoid), ``sft_weight`` (RPO's NLL on the chosen answers) and the frozen ``reference``: copy
    (the starting weights, sharded like the policy), adapters_off (with model.lora: the base
    model, adapters switched off, no second copy) or cached (its log-probs computed once before
    step 1)."""

    method: str = "sigmoid"
    beta: Optional[float] = None
    label_smoothing: float = 0.0
    sft_weight: float = 0.0
    reference: str = "copy"

    def __post_init__(self):
        if isinstance(self.beta, str) and EXPONENT.match(self.beta):
            self.beta = float(self.beta)  # YAML 1.1 reads 1e3 (no dot) as a string
        if self.beta is not None and (isinstance(self.beta, (str, bool)) or not isinstance(self.beta, (int, float))):
            raise ValueError(f"dpo.beta must be a number, got {self.beta!r}")
        self.settings()  # checks method, beta, label_smoothing, sft_weight
        if self.reference not in DPO_REFERENCES:
            raise ValueError(f"dpo.reference must be one of {', '.join(DPO_REFERENCES)}, got {self.reference!r}")

    def settings(self):
        """The objective's mm_parallel.preference.Settings."""
        from mm_parallel.preference import Settings

        return Settings(self.method, 0.1 if self.beta is None else self.beta, self.label_smoothing, self.sft_weight)


@dataclass
class GrpoSection:
    """grpo: Group Relative Policy Optimization (train.objective grpo; trl's GRPOConfig names).
    Each step's train.global_batch_size prompts get ``num_generations`` sampled completions each
    (``temperature``, ``top_p``, ``top_k``, at most ``max_completion_length`` tokens), scored by
    the weighted ``rewards`` ({name: weight}: accuracy, format — matching ``format_pattern`` —
    or "module:function"); advantages within each prompt's group (``scale_rewards``: divided by
    the group's std, the batch's, or not); the clipped ratio loss (``epsilon``, ``epsilon_high``)
    plus ``beta`` times the KL to the reference (``reference`` copy | adapters_off; beta 0 loads
    none), on one batch of rollouts ``num_iterations`` optimizer steps (mm_parallel.grpo)."""

    num_generations: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_completion_length: int = 256
    rewards: Dict[str, float] = field(default_factory=lambda: {"accuracy": 1.0})
    format_pattern: Optional[str] = None  # the format reward's regex (unset: R1's <think> / <answer> layout)
    scale_rewards: str = "group"
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None
    beta: float = 0.0
    reference: str = "copy"
    num_iterations: int = 1

    def __post_init__(self):
        for name in ("temperature", "top_p", "epsilon", "epsilon_high", "beta"):
            value = getattr(self, name)
            if isinstance(value, str) and EXPONENT.match(value):
                setattr(self, name, float(value))
        if isinstance(self.num_generations, bool) or not isinstance(self.num_generations, int) or \
                self.num_generations < 2:
            raise ValueError(f"grpo.num_generations must be an integer >= 2 (a group's advantages compare its "
                             f"completions), got {self.num_generations!r}")
        if self.max_completion_length < 1 or self.num_iterations < 1:
            raise ValueError("grpo.max_completion_length and grpo.num_iterations must be >= 1")
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"grpo.scale_rewards must be one of {', '.join(SCALE_REWARDS)}, got "
                             f"{self.scale_rewards!r}")
        if self.reference not in GRPO_REFERENCES:
            raise ValueError(f"grpo.reference must be one of {', '.join(GRPO_REFERENCES)}, got {self.reference!r}")
        if not isinstance(self.rewards, dict) or not self.rewards or not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) for w in self.rewards.values()):
            raise ValueError(f"grpo.rewards must map reward functions to weights, e.g. {{accuracy: 1.0, format: 0.5}}; "
                             f"got {self.rewards!r}")
        self.sampling()
        self.settings()

    def sampling(self):
        """The rollouts' mm_parallel.sampling.Sampling."""
        from mm_parallel.sampling import Sampling

        return Sampling(do_sample=True, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)

    def settings(self):
        """The objective's mm_parallel.grpo.Settings."""
        from mm_parallel.grpo import Settings

        return Settings(self.epsilon, self.epsilon_high, self.beta, self.temperature)


OBJECTIVE_SECTIONS = {"dpo": DpoSection, "grpo": GrpoSection}


def check_objective(spec, built: dict, given: set) -> None:
    """train.objective: one of the family's (unset: its first); a section (``given``: the objective
    sections the recipe wrote) only with its objective, and the reference what the run can hold."""
    train = built["train"]
    if train.objective is None:
        train.objective = spec.objectives[0]
    if train.objective not in spec.objectives:
        raise ValueError(f"train.objective {train.objective!r} is not one family {spec.name} trains; choose one of "
                         f"{', '.join(spec.objectives)}")
    for name in sorted(given - {train.objective}):
        raise ValueError(f"the {name} section sets the {name} objective, and train.objective is {train.objective}: "
                         f"set train.objective: {name}, or drop the section")
    if train.objective == "dpo":
        _check_dpo(built, built["dpo"])
    elif train.objective == "grpo":
        _check_grpo(built, built["grpo"])


def _check_dpo(built: dict, dpo: DpoSection) -> None:
    train = built["train"]
    if dpo.reference == "adapters_off" and built["model"].lora is None:
        raise ValueError("dpo.reference adapters_off is the base model under LoRA adapters switched off, and "
                         "model.lora is not set: add a model.lora section, or use dpo.reference copy")
    if dpo.reference == "cached" and built["eval"].path:
        raise ValueError("dpo.reference cached holds the reference's values of the training data's pairs; eval.path's "
                         "pairs are not among them: hold out eval.fraction instead, or use dpo.reference copy")
    if train.loss_normalization is not None:
        raise ValueError(f"train.loss_normalization={train.loss_normalization} weighs answer tokens; the dpo "
                         "objective averages over the global batch's pairs: leave it unset")


def _check_grpo(built: dict, grpo: GrpoSection) -> None:
    if grpo.beta and grpo.reference == "adapters_off" and built["model"].lora is None:
        raise ValueError("grpo.reference adapters_off is the base model under LoRA adapters switched off, and "
                         "model.lora is not set: add a model.lora section, or use grpo.reference copy")
    if built["eval"].every or built["eval"].fraction or built["eval"].path:
        raise ValueError("grpo has no validation loss (its loss is its rollouts'): drop eval.every / eval.fraction / "
                         "eval.path, and see answers to eval.prompts with eval.sample_every")
    if built["train"].global_batch_tokens is not None:
        raise ValueError("train.global_batch_tokens counts a step's tokens, which rollouts decide: count the step's "
                         "prompts with train.global_batch_size")
    max_length = getattr(built["data"], "max_length", None)
    if max_length is not None and max_length <= grpo.max_completion_length:
        raise ValueError(f"data.max_length={max_length} holds a prompt and its completion of up to "
                         f"grpo.max_completion_length={grpo.max_completion_length} tokens: raise data.max_length")
