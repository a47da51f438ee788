"""trl's GRPO loss, computed by trl's own code: `GRPOTrainer._compute_loss` (trl 1.16) run on a
stand-in of the trainer's state whose per-token log-probabilities are the ones given.

trl keeps the clipped objective, the KL term and the aggregations inside that method (no function
of their own), so the test calls the method with what it reads: the trainer's settings, an
accelerator of one process, and the policy's log-probs of the completion tokens (what trl's
model pass would return) — the ratio, clipping, KL and loss types then come from trl's formulas.
"""

from collections import defaultdict
from types import SimpleNamespace


def trl_grpo_loss(token_log_probs, completion_mask, advantages, old_log_probs=None, ref_log_probs=None,
                  loss_type="dapo", epsilon=0.2, epsilon_high=None, beta=0.0):
    """trl's loss (a torch scalar, differentiable in ``token_log_probs``) of B completions:
    ``token_log_probs`` (B, T) the policy's log-probs of the completion tokens, ``completion_mask``
    (B, T), ``advantages`` (B,), the sampling policy's and the reference's (B, T) log-probs (None:
    trl's own defaults — this update's, detached; no reference when beta is 0)."""
    import torch
    from trl.trainer.grpo_trainer import GRPOTrainer

    zeros = torch.zeros_like(token_log_probs)
    model = torch.nn.Linear(1, 1).train()
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x,
                                  reduce=lambda x, reduction="sum": x, num_processes=1, sync_gradients=True)
    args = SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1)
    trainer = SimpleNamespace(
        model=model, accelerator=accelerator, args=args, beta=beta, loss_type=loss_type, epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high, importance_sampling_level="token",
        off_policy_mask_threshold=None, top_entropy_quantile=1.0, use_vllm=False, aux_loss_enabled=False,
        _entropy_bonus_enabled=False, current_gradient_accumulation_steps=1, max_completion_length=None,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (token_log_probs, zeros, None))
    ids = torch.zeros(completion_mask.shape, dtype=torch.long)
    inputs = {"prompt_ids": ids[:, :1], "prompt_mask": torch.ones_like(ids[:, :1]), "completion_ids": ids,
              "completion_mask": completion_mask, "advantages": advantages,
              "num_items_in_batch": completion_mask.sum().float()}
    if old_log_probs is not None:
        inputs["old_per_token_logps"] = old_log_probs
    if ref_log_probs is not None:
        inputs["ref_per_token_logps"] = ref_log_probs
    return GRPOTrainer._compute_loss(trainer, model, inputs), trainer._metrics["train"]
