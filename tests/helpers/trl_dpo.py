"""trl's DPO loss, computed by trl's own code: `DPOTrainer._compute_loss` (trl 1.16) run on a
stand-in of the trainer's state and of the model's fused-LM-head output.

trl keeps its losses inside that method (no function of their own), so the test calls the method
with what it reads: the trainer's settings, an accelerator that gathers nothing (one process),
and a model whose output carries the per-token log-probabilities given — the sequences'
log-probs then come from trl's masking and sums, the loss from trl's formulas.
"""

from collections import defaultdict
from types import SimpleNamespace


def trl_dpo_loss(token_log_probs, completion_mask, reference_chosen, reference_rejected, loss_types=("sigmoid",),
                 loss_weights=(1.0,), beta=0.1, label_smoothing=0.0):
    """trl's loss (a torch scalar, differentiable in ``token_log_probs``) for 2P sequences
    [chosen..., rejected...]: ``token_log_probs`` (2P, L - 1) the log-probs of each next token
    (position t predicts token t + 1), ``completion_mask`` (2P, L) the answer tokens, the
    reference's (P,) sequence log-probs."""
    import torch
    from trl.trainer.dpo_trainer import DPOTrainer

    class Model(torch.nn.Module):
        def forward(self, labels=None, **_):
            shifted = labels[:, 1:] != -100  # trl passes the answer tokens as labels
            logps = token_log_probs * shifted
            zeros = torch.zeros_like(token_log_probs)
            return SimpleNamespace(log_probs=logps, entropy=zeros, mean_logits=zeros, is_top1=shifted)

    model = Model().train()
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x,
                                  unwrap_model=lambda m: m)
    trainer = SimpleNamespace(model=model, accelerator=accelerator, aux_loss_enabled=False, precompute_ref_logps=True,
                              ld_alpha=None, f_divergence_type="reverse_kl", loss_types=list(loss_types),
                              loss_weights=list(loss_weights), beta=beta, label_smoothing=label_smoothing,
                              use_weighting=False, _metrics=defaultdict(lambda: defaultdict(list)),
                              _total_train_tokens=0, _tp_size=1, args=SimpleNamespace())
    ids = torch.zeros(completion_mask.shape, dtype=torch.long)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": completion_mask,
              "ref_chosen_logps": reference_chosen, "ref_rejected_logps": reference_rejected}
    return DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
