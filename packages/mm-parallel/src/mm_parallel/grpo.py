"""Group Relative Policy Optimization (GRPO, Shao et al. 2024) on per-token log-probabilities, as trl's GRPOTrainer.

A prompt x has G completions y_1 .. y_G with rewards r_i (the weighted sum of the reward
functions). Each completion's advantage is its reward against its group's (`group_advantages`):

    A_i = (r_i - mean_j r_j) / (std_j r_j + 1e-4)     scale_rewards "group" (std with Bessel's
                                                       correction); "batch": the batch's std;
                                                       "none": not divided (Dr. GRPO)

For each completion token t, with pi the policy, pi_old the policy that sampled the rollouts
and pi_ref the reference (log-probabilities of the logits / temperature, the distribution the
tokens were drawn from):

    rho_t = exp(log pi(y_t) - log pi_old(y_t))         (pi_old = stop_gradient(pi) when the
                                                        rollouts are this update's: rho = 1)
    k3_t  = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1     (Schulman's KL estimator)
    l_t   = -min(rho_t A_i, clip(rho_t, 1 - eps, 1 + eps_high) A_i) + beta k3_t

and the loss sums w_t l_t over the tokens, the weights chosen by the aggregation
(train.loss_normalization): "token" w_t = 1 / (completion tokens in the global batch), trl's
loss_type "dapo"; "sample" w_t = 1 / (|y_i| x completions in the global batch), each
completion's mean over its tokens averaged, trl's "grpo". The caller folds the layout's
averaging into the weights (mm_train.loss_share's D_r): a micro-batch's loss is its share of
the global batch's, added up by the pipeline's and data parallelism's means.

Per-token values are host arrays over the whole sequence (next-token targets' positions: the
value at position s is for the token at s + 1, 0 where there is none); the model cuts them to
its rank's positions (`target_part`), as it cuts its targets under context parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from mindspore import Tensor, ops

SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("token", "sample")


@dataclass(frozen=True)
class Settings:
    """The clipped objective's settings (a recipe's ``grpo:`` section)."""

    epsilon: float = 0.2
    epsilon_high: Optional[float] = None  # None: epsilon (symmetric clipping); DAPO's clip-higher above it
    beta: float = 0.0  # KL weight; 0 loads no reference model (trl's default)
    temperature: float = 1.0  # the sampling temperature the log-probabilities are taken at

    def __post_init__(self):
        if not 0 < self.epsilon < 1:
            raise ValueError(f"grpo.epsilon must be in (0, 1), got {self.epsilon}")
        if self.epsilon_high is not None and not self.epsilon_high > 0:
            raise ValueError(f"grpo.epsilon_high must be > 0 (unset: epsilon), got {self.epsilon_high}")
        if self.beta < 0:
            raise ValueError(f"grpo.beta must be >= 0 (0: no KL term, no reference model), got {self.beta}")
        if not self.temperature > 0:
            raise ValueError(f"grpo.temperature must be > 0, got {self.temperature}")

    @property
    def upper(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def group_advantages(rewards: np.ndarray, group: int, scale: str = "group") -> np.ndarray:
    """(N,) float32 advantages of (N,) rewards in consecutive groups of ``group`` (module docstring)."""
    if scale not in SCALE_REWARDS:
        raise ValueError(f"grpo.scale_rewards={scale!r} is unknown; use one of {', '.join(SCALE_REWARDS)}")
    rewards = np.asarray(rewards, np.float64)
    if group < 1 or rewards.size % group:
        raise ValueError(f"{rewards.size} rewards do not make groups of {group} completions")
    grouped = rewards.reshape(-1, group)
    advantages = grouped - grouped.mean(1, keepdims=True)
    if scale == "group":
        std = grouped.std(1, ddof=1, keepdims=True) if group > 1 else np.zeros_like(grouped)
        advantages = advantages / (std + 1e-4)
    elif scale == "batch":
        std = rewards.std(ddof=1) if rewards.size > 1 else 0.0
        advantages = advantages / (std + 1e-4)
    return advantages.reshape(-1).astype(np.float32)


def aggregation_weights(completion_mask: np.ndarray, aggregation: str, completions_in_batch: float,
                        tokens_in_batch: float) -> np.ndarray:
    """(rows, tokens) float32 weights w_t of a micro-batch's completion tokens (``completion_mask``
    1 on them) for the global batch's loss (module docstring)."""
    mask = np.asarray(completion_mask, np.float64)
    if aggregation == "token":
        return (mask / max(float(tokens_in_batch), 1.0)).astype(np.float32)
    if aggregation == "sample":
        lengths = np.maximum(mask.sum(1, keepdims=True), 1.0)
        return (mask / lengths / max(float(completions_in_batch), 1.0)).astype(np.float32)
    raise ValueError(f"train.loss_normalization={aggregation!r} is unknown; use one of {', '.join(AGGREGATIONS)}")


def token_losses(logps, old_logps, ref_logps, advantages, settings: Settings):
    """(l_t, rho_t, k3_t or None): the module docstring's per-token loss, ratio and KL, elementwise
    on tensors of one shape (``ref_logps`` None when beta = 0)."""
    ratio = ops.exp(logps - ops.stop_gradient(old_logps))
    clipped = ops.clamp(ratio, 1.0 - settings.epsilon, 1.0 + settings.upper)
    losses = -ops.minimum(ratio * advantages, clipped * advantages)
    kl = None
    if settings.beta:
        delta = ops.stop_gradient(ref_logps) - logps
        kl = ops.exp(delta) - delta - 1.0
        losses = losses + settings.beta * kl
    return losses, ratio, kl


@dataclass(frozen=True)
class PolicyBatch:
    """A micro-batch's rollouts, handed to the model with its inputs (forward keyword
    ``preference``, the objectives' slot): per target position (rows, seq) host arrays of the
    sampling policy's and the reference's log-probs (None: this update's own, no gradient; no
    reference when beta = 0), each token's advantage and aggregation weight."""

    advantages: np.ndarray  # (rows, seq) float32, the completion's A_i on its tokens
    weights: np.ndarray  # (rows, seq) float32, w_t (0 off the completions)
    old_logps: Optional[np.ndarray] = None
    ref_logps: Optional[np.ndarray] = None
    settings: Settings = field(default_factory=Settings)
    # this forward's per-token values for the metrics (no gradient): "logps", "ratio", "kl"
    observed: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if self.settings.beta and self.ref_logps is None:
            raise ValueError("grpo.beta > 0 needs the reference's log-probs (ref_logps)")

    def model_loss(self, model, logits, plan):
        """The micro-batch's share of the loss from the model's logits (its rank's positions)."""
        logps = model.token_log_probs(logits, plan, self.settings.temperature)
        part = lambda array: Tensor(model.target_part(array).astype(np.float32))  # noqa: E731
        old = ops.stop_gradient(logps) if self.old_logps is None else part(self.old_logps)
        ref = part(self.ref_logps) if self.settings.beta else None
        losses, ratio, kl = token_losses(logps, old, ref, part(self.advantages), self.settings)
        self.observed.update(logps=ops.stop_gradient(logps), ratio=ops.stop_gradient(ratio),
                             kl=None if kl is None else ops.stop_gradient(kl))
        return model.reduce_loss_over_cp((losses * part(self.weights)).sum())
