"""Preference objectives: DPO and its IPO / hinge forms on sequence log-probabilities, and
Diffusion-DPO on the denoising errors of video clips (`DiffusionPairs`).

A pair is a prompt x with a chosen answer y_w and a rejected one y_l. With the policy pi and a
frozen reference pi_ref, each answer's log-ratio and the pair's margin are

    r_w = log pi(y_w | x) - log pi_ref(y_w | x)        r_l likewise        D = r_w - r_l

(log pi(y | x): the sum over the answer's tokens of their log-probabilities, `sequence_log_probs`)
and the per-pair losses, with beta > 0 and label smoothing e in [0, 0.5):

    sigmoid  (DPO, Rafailov et al. 2023; e > 0: conservative DPO)
             -(1 - e) log sigmoid(beta D) - e log sigmoid(-beta D)
    ipo      (Azar et al. 2023, the log-ratios per answer token as TRL takes them)
             (r_w / |y_w| - r_l / |y_l| - 1 / (2 beta))^2
    hinge    (SLiC, Zhao et al. 2023)
             max(0, 1 - beta D)

At the start (pi = pi_ref, D = 0) they are ln 2, (1 / (2 beta))^2 and 1. RPO (Pang et al. 2024)
adds sft_weight times the chosen answers' negative log-likelihood per token. The rewards the
metrics report are beta r_w and beta r_l; a pair is ranked right when beta r_w > beta r_l.

Sequence log-probabilities from per-token ones (``token_log_probs``: log p of each next-token
target of this rank's part of the sequence, 0 where there is none), in the form of
mm_parallel.mappings:

    region               forward                                  backward
    sequence_log_probs   s_k = sum_j sum_{t in k, on rank j} l_t    dl_t = ds_k(t)
                         (a segment sum, then reduce_from_region over the context-parallel group)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from mm_parallel import mappings
from mm_parallel.ops.device import as_type

METHODS = ("sigmoid", "ipo", "hinge")
DIFFUSION_BETA = 2500.0  # diffusers' Diffusion-DPO script's default beta_dpo 5000, times its 0.5


@dataclass(frozen=True)
class Settings:
    """A recipe's ``dpo:`` section as the objective reads it."""

    method: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    sft_weight: float = 0.0  # RPO: the chosen answers' NLL per token, times this, added

    def __post_init__(self):
        check_settings(self.method, self.beta, self.label_smoothing)
        if self.sft_weight < 0:
            raise ValueError(f"dpo.sft_weight must be >= 0 (0: plain DPO), got {self.sft_weight}")


@dataclass(frozen=True)
class PairedBatch:
    """A micro-batch's pairs, handed to the model with its inputs (forward keyword
    ``preference``): which of its sequences are each pair's chosen and rejected answers, the
    reference's log-probs of both and their answer lengths; ``pairs_in_batch`` (and, for RPO,
    ``chosen_tokens_in_batch``) over the global batch, so that the micro-batches' losses add up to
    the global batch's mean over its pairs."""

    chosen: np.ndarray  # (P,) sequence numbers (a packed row's samples, or a batch's rows)
    rejected: np.ndarray
    reference_chosen: np.ndarray  # (P,) float32
    reference_rejected: np.ndarray
    chosen_tokens: np.ndarray  # (P,) answer tokens
    rejected_tokens: np.ndarray
    pairs_in_batch: float
    chosen_tokens_in_batch: float
    settings: Settings = field(default_factory=Settings)
    # the policy's log-probs of the last forward ("chosen", "rejected"; no gradient): the metrics'
    observed: dict = field(default_factory=dict, compare=False, repr=False)

    def model_loss(self, model, logits, plan):
        """The loss from a model's logits: of its sequences' log-probs (``model.sequence_log_probs``)."""
        return self.loss(model.sequence_log_probs(logits, plan))

    def loss(self, sequence_logps):
        """This micro-batch's share of the global batch's loss from the policy's (S,) sequence
        log-probs: sum over its pairs of the per-pair loss / pairs_in_batch (+ RPO's share)."""
        cfg = self.settings
        chosen = ops.gather(sequence_logps, Tensor(self.chosen.astype(np.int32)), 0)
        rejected = ops.gather(sequence_logps, Tensor(self.rejected.astype(np.int32)), 0)
        self.observed.update(chosen=ops.stop_gradient(chosen), rejected=ops.stop_gradient(rejected))
        losses = preference_losses(chosen, rejected, Tensor(self.reference_chosen), Tensor(self.reference_rejected),
                                   cfg.method, cfg.beta, cfg.label_smoothing,
                                   Tensor(self.chosen_tokens.astype(np.float32)),
                                   Tensor(self.rejected_tokens.astype(np.float32)))
        loss = losses.sum() / _divisor(self.pairs_in_batch)
        if cfg.sft_weight:
            loss = loss + cfg.sft_weight * chosen_nll(chosen, self.chosen_tokens_in_batch)
        return loss


@dataclass(frozen=True)
class DiffusionPairs:
    """A micro-batch's clip pairs for Diffusion-DPO (Wallace et al. 2023), handed to a video model
    as ``preference``: both clips of a pair share their noise and timestep, e is each sample's
    mean squared error of the model's prediction against its target over the latent elements
    (flow matching's velocity, v-prediction's v), r the frozen reference's, and

        loss_p = -log sigmoid(-beta ((e_w - r_w) - (e_l - r_l)))

    the diffusion timesteps' factor T folded into beta (as diffusers' Diffusion-DPO training
    script writes it: -logsigmoid(-0.5 beta_dpo (model_diff - ref_diff)), its 0.5 in beta here).
    The loss is the sum over the micro-batch's pairs / ``pairs_in_batch`` (loss_share's D_r)."""

    chosen: np.ndarray  # (P,) sample numbers in the micro-batch
    rejected: np.ndarray
    reference_chosen: np.ndarray  # (P,) float32 reference errors
    reference_rejected: np.ndarray
    pairs_in_batch: float
    beta: float = DIFFUSION_BETA
    # the policy's errors of the last forward ("chosen", "rejected"; no gradient): the metrics'
    observed: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if not self.beta > 0:
            raise ValueError(f"dpo.beta must be > 0, got {self.beta}")

    def loss(self, errors):
        """The micro-batch's share of the global batch's loss from the policy's (B,) errors."""
        chosen = ops.gather(errors, Tensor(self.chosen.astype(np.int32)), 0)
        rejected = ops.gather(errors, Tensor(self.rejected.astype(np.int32)), 0)
        self.observed.update(chosen=ops.stop_gradient(chosen), rejected=ops.stop_gradient(rejected))
        margin = (chosen - Tensor(self.reference_chosen)) - (rejected - Tensor(self.reference_rejected))
        return -log_sigmoid(-self.beta * margin).sum() / _divisor(self.pairs_in_batch)


class ReferencePass:
    """A forward's ``preference`` that keeps what a preference loss reads — each sequence's
    log-probability, or each clip's denoising error — as ``values`` (no gradient) in place of a
    loss: the reference model's pass, through the same forward and pipeline code as the policy's.
    Its "loss" is their sum (nothing differentiates it)."""

    def __init__(self):
        self.values = None

    def model_loss(self, model, logits, plan):
        return self.loss(model.sequence_log_probs(logits, plan))

    def loss(self, values):
        self.values = ops.stop_gradient(values)
        return self.values.sum()


def sequence_log_probs(token_log_probs, sequence_index, count: int, cp_group=None):
    """(count,) float32: each sequence's summed token log-probabilities (module docstring).
    ``sequence_index``: the sequence (0 .. count - 1) of each position of ``token_log_probs``,
    -1 for none; a host array or tensor of the same shape."""
    index = np.asarray(sequence_index.asnumpy() if isinstance(sequence_index, Tensor) else sequence_index)
    if index.shape != tuple(token_log_probs.shape):
        raise ValueError(f"sequence_index {index.shape} does not match the token log-probs "
                         f"{tuple(token_log_probs.shape)}")
    index = np.where(index < 0, count, index).astype(np.int32).reshape(-1)  # slot `count` collects the rest
    flat = as_type(token_log_probs, ms.float32).reshape(-1)
    sums = ops.unsorted_segment_sum(flat, Tensor(index), count + 1)[:count]
    if cp_group is not None and cp_group.size > 1:
        sums = mappings.reduce_from_region(sums, cp_group)
    return sums


def preference_losses(policy_chosen, policy_rejected, reference_chosen, reference_rejected, method: str = "sigmoid",
                      beta: float = 0.1, label_smoothing: float = 0.0, chosen_tokens=None, rejected_tokens=None):
    """(P,) per-pair losses of the module docstring; the inputs (P,) sequence log-probabilities
    (the reference's without gradient); ``chosen_tokens`` / ``rejected_tokens``: (P,) answer
    lengths, which ipo needs."""
    check_settings(method, beta, label_smoothing)
    chosen = policy_chosen - ops.stop_gradient(reference_chosen)
    rejected = policy_rejected - ops.stop_gradient(reference_rejected)
    if method == "sigmoid":
        margin = beta * (chosen - rejected)
        return -(1.0 - label_smoothing) * log_sigmoid(margin) - label_smoothing * log_sigmoid(-margin)
    if method == "hinge":
        return ops.relu(1.0 - beta * (chosen - rejected))
    if chosen_tokens is None or rejected_tokens is None:
        raise ValueError("ipo takes the log-ratios per answer token: give chosen_tokens and rejected_tokens")
    per_token = chosen / ops.clamp(chosen_tokens, min=1.0) - rejected / ops.clamp(rejected_tokens, min=1.0)
    return (per_token - 1.0 / (2.0 * beta)) ** 2


def chosen_nll(policy_chosen, chosen_tokens: float):
    """RPO's added term: the chosen answers' negative log-likelihood per token, -sum_p log pi(y_w,p)
    / ``chosen_tokens`` (the chosen answers' tokens over the batch the loss averages over)."""
    return -policy_chosen.sum() / _divisor(chosen_tokens)


def _divisor(value) -> float:
    """A share of the global batch's count (mm_train.loss_share's D_r: below 1 when a rank's
    micro-batches outnumber its share), or 1 where there is nothing to divide."""
    value = float(value)
    return value if value > 0 else 1.0


def log_sigmoid(x):
    """log sigmoid(x) = -softplus(-x): finite for any x (MindSpore 2.7.2's ops.logsigmoid gives
    -inf below about -100, where a large beta's margins go), its gradient sigmoid(-x)."""
    return -ops.softplus(-x)


def rewards(policy, reference, beta: float):
    """beta (log pi - log pi_ref) of each answer, without gradient (the metrics' rewards)."""
    return ops.stop_gradient(beta * (policy - reference))


def starting_loss(method: str, beta: float, label_smoothing: float = 0.0) -> float:
    """The loss at pi = pi_ref (D = 0): what a run's first step must show."""
    if method == "sigmoid":
        return math.log(2.0)  # -(1 - e) log(1/2) - e log(1/2), whatever e
    if method == "ipo":
        return (1.0 / (2.0 * beta)) ** 2
    return 1.0


def check_settings(method: str, beta: float, label_smoothing: float) -> None:
    """Refuse what the objective cannot mean, saying what to change."""
    if method not in METHODS:
        raise ValueError(f"dpo.method={method!r} is unknown; use one of {', '.join(METHODS)}")
    if not beta > 0:
        raise ValueError(f"dpo.beta must be > 0 (how far from the reference the policy may go), got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"dpo.label_smoothing must be in [0, 0.5) (the share of pairs taken as mislabelled), "
                         f"got {label_smoothing}")
    if label_smoothing and method != "sigmoid":
        raise ValueError(f"dpo.label_smoothing applies to the sigmoid form only, not {method}; set it to 0")
