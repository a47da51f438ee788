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

import mindspore as ms
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


def group_advantages(rewards: np.ndarray, group: int, scale: str = "group",
                     batch_std: Optional[float] = None) -> np.ndarray:
    """(N,) float32 advantages of (N,) rewards in consecutive groups of ``group`` (module
    docstring). A NaN reward (no reward function scored the completion) is left out of its
    group's mean and std, and its advantage is 0 (trl's). ``batch_std``: scale "batch"'s std over
    the whole global batch when this is a part of it (default: these rewards')."""
    if scale not in SCALE_REWARDS:
        raise ValueError(f"grpo.scale_rewards={scale!r} is unknown; use one of {', '.join(SCALE_REWARDS)}")
    rewards = np.asarray(rewards, np.float64)
    if group < 1 or rewards.size % group:
        raise ValueError(f"{rewards.size} rewards do not make groups of {group} completions")
    grouped = rewards.reshape(-1, group)
    scored = ~np.isnan(grouped)
    mean = np.nanmean(np.where(scored.any(1, keepdims=True), grouped, 0.0), 1, keepdims=True)
    advantages = grouped - mean
    if scale == "group":
        advantages = advantages / (_nanstd(grouped, 1) + 1e-4)
    elif scale == "batch":
        advantages = advantages / ((_nanstd(rewards, None) if batch_std is None else batch_std) + 1e-4)
    return np.where(scored, advantages, 0.0).reshape(-1).astype(np.float32)


def _nanstd(values: np.ndarray, axis) -> np.ndarray:
    """The standard deviation with Bessel's correction over the non-NaN values (trl's nanstd; 0
    where fewer than two)."""
    count = (~np.isnan(values)).sum(axis, keepdims=axis is not None)
    if np.all(count < 2):
        return np.zeros_like(count, np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        std = np.sqrt(np.nansum((values - np.nanmean(values, axis, keepdims=True)) ** 2, axis,
                                keepdims=axis is not None) / (count - 1))
    return np.where(count > 1, std, 0.0)


def batch_moments(rewards: np.ndarray) -> np.ndarray:
    """(sum, sum of squares, count) of the scored rewards: summed over data-parallel ranks, what
    `std_of_moments` makes the global batch's std of (scale_rewards batch)."""
    scored = np.asarray(rewards, np.float64)[~np.isnan(rewards)]
    return np.array([scored.sum(), (scored ** 2).sum(), scored.size], np.float64)


def std_of_moments(moments: np.ndarray) -> float:
    total, squares, count = (float(v) for v in moments)
    if count < 2:
        return 0.0
    return float(np.sqrt(max(squares - total * total / count, 0.0) / (count - 1)))


def aggregation_weights(completion_mask: np.ndarray, aggregation: str, completions_in_batch: float,
                        tokens_in_batch: float, sequence: Optional[np.ndarray] = None) -> np.ndarray:
    """(rows, tokens) float32 weights w_t of a micro-batch's completion tokens (``completion_mask``
    1 on them) for the global batch's loss (module docstring); ``sequence``: each position's
    completion (a packed row's segments; default: its row)."""
    mask = np.asarray(completion_mask, np.float64)
    if aggregation == "token":
        return (mask / max(float(tokens_in_batch), 1.0)).astype(np.float32)
    if aggregation != "sample":
        raise ValueError(f"train.loss_normalization={aggregation!r} is unknown; use one of {', '.join(AGGREGATIONS)}")
    if sequence is None:
        sequence = np.broadcast_to(np.arange(mask.shape[0])[:, None], mask.shape)
    sequence = np.where(mask > 0, sequence, 0).astype(np.int64)
    lengths = np.bincount(sequence.reshape(-1), weights=mask.reshape(-1), minlength=int(sequence.max()) + 1)
    return (mask / np.maximum(lengths[sequence], 1.0) / max(float(completions_in_batch), 1.0)).astype(np.float32)


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
    # this forward's sums over the completion tokens (weights > 0) for the metrics, no gradient:
    # "tokens", "kl", "clipped" (tokens whose clipped term was the smaller: no gradient through rho)
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
        advantages, weights = part(self.advantages), part(self.weights)
        losses, ratio, kl = token_losses(logps, old, ref, advantages, self.settings)
        self._observe(ops.stop_gradient(ratio), None if kl is None else ops.stop_gradient(kl), advantages,
                      (weights > 0).astype(ms.float32))
        return model.reduce_loss_over_cp((losses * weights).sum())

    def _observe(self, ratio, kl, advantages, mask) -> None:
        """This rank's sums for the metrics (trl's clip_ratio/region_mean: clipped below with A < 0
        or above with A > 0)."""
        clipped = ((ratio < 1.0 - self.settings.epsilon) & (advantages < 0)) | \
            ((ratio > 1.0 + self.settings.upper) & (advantages > 0))
        self.observed.update(tokens=mask.sum(), clipped=(clipped.astype(ms.float32) * mask).sum(),
                             kl=(kl * mask).sum() if kl is not None else ops.zeros((), ms.float32))


class TokenLogProbs:
    """A forward's ``preference`` that keeps each target's log-probability at ``temperature`` over
    the whole sequence (gathered over cp) as ``values`` (no gradient) in place of a loss: the
    sampling policy's before an update, or the reference's (GRPO's pi_old and pi_ref), through
    the same forward and pipeline code as the policy's."""

    def __init__(self, temperature: float = 1.0):
        self.temperature, self.values = temperature, None

    def model_loss(self, model, logits, plan):
        from mm_parallel.context_parallel import gather_sequence

        logps = ops.stop_gradient(model.token_log_probs(logits, plan, self.temperature))
        self.values = gather_sequence(logps, 1, model.topology) if model.topology.cp.size > 1 else logps
        return logps.sum()
