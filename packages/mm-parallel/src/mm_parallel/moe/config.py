"""`MoEConfig`: what a mixture-of-experts layer computes, checked when it is made.

Names follow transformers' MoE configs where one exists (``num_experts``, ``num_experts_per_tok``
as ``top_k``, ``moe_intermediate_size``, ``norm_topk_prob``, ``router_aux_loss_coef`` as
``aux_loss_coef``, ``shared_expert_intermediate_size``); the rest are Megatron-Core's options
(``moe_router_score_function`` order, ``moe_z_loss_coeff``, ``moe_router_enable_expert_bias``,
``moe_expert_capacity_factor``, ``moe_token_drop_policy``, ``moe_pad_expert_input_to_capacity``,
``moe_token_dispatcher_type``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

SCORE_ORDERS = ("softmax_topk", "topk_softmax")
DROP_POLICIES = ("probs", "position")
DISPATCHERS = ("alltoall", "allgather")


@dataclass(frozen=True)
class MoEConfig:
    """A top-k routed MoE block.

    score_order      "softmax_topk": softmax over all experts in fp32, then the top k (transformers'
                     Qwen3-MoE / Qwen3-VL-MoE); "topk_softmax": the top k logits, softmax over them
    norm_topk_prob   renormalise the k weights to sum to one (softmax_topk only; topk_softmax sums to one)
    aux_loss_coef    weight of transformers' load-balancing loss (`load_balancing_loss`), added by the model
    z_loss_coef      weight of the router z-loss (ST-MoE: mean over tokens of logsumexp(logits)^2)
    expert_bias      aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores
                     that choose the experts (not to the weights), moved by ``bias_update_rate``
                     towards balance after each optimizer step (`update_expert_biases`)
    capacity_factor  None: dropless; a number: each expert takes at most
                     ceil(capacity_factor * tokens * top_k / num_experts) of a rank's tokens, the
                     rest dropped by ``drop_policy`` ("probs": the lowest weights, "position": the
                     latest tokens); ``pad_to_capacity`` fills every expert to capacity (fixed shapes)
    dispatcher       "alltoall" (dropless all-to-all over ep) or "allgather" (small ep)
    shared_expert_intermediate_size   0: none; else a dense gated MLP every token also passes
                     (Qwen2-MoE), scaled by sigmoid(shared_expert_gate(x)) when ``shared_expert_gate``
    """

    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    hidden_act: str = "silu"
    score_order: str = "softmax_topk"
    norm_topk_prob: bool = True
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    capacity_factor: Optional[float] = None
    drop_policy: str = "probs"
    pad_to_capacity: bool = False
    dispatcher: str = "alltoall"
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False

    def __post_init__(self):
        for name in ("hidden_size", "moe_intermediate_size", "num_experts", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEConfig.{name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        for name, value, allowed in (("score_order", self.score_order, SCORE_ORDERS),
                                     ("drop_policy", self.drop_policy, DROP_POLICIES),
                                     ("dispatcher", self.dispatcher, DISPATCHERS)):
            if value not in allowed:
                raise ValueError(f"MoEConfig.{name}={value!r} is unknown; use one of {', '.join(allowed)}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor={self.capacity_factor!r} must be positive (or None: dropless)")
        if self.pad_to_capacity and self.capacity_factor is None:
            raise ValueError("pad_to_capacity needs a capacity_factor (dropless experts have no capacity)")
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise ValueError("shared_expert_gate needs shared_expert_intermediate_size > 0")

    @classmethod
    def from_hf(cls, text_config, **options) -> "MoEConfig":
        """From a transformers MoE text config (Qwen3-MoE, Qwen3-VL-MoE, Qwen2-MoE); ``options`` override."""
        get = text_config.get if isinstance(text_config, dict) else lambda k, d=None: getattr(text_config, k, d)
        values = dict(hidden_size=get("hidden_size"), moe_intermediate_size=get("moe_intermediate_size"),
                      num_experts=get("num_experts"), top_k=get("num_experts_per_tok"),
                      hidden_act=get("hidden_act", "silu"), norm_topk_prob=bool(get("norm_topk_prob", True)),
                      aux_loss_coef=float(get("router_aux_loss_coef", 0.0) or 0.0),
                      shared_expert_intermediate_size=int(get("shared_expert_intermediate_size", 0) or 0))
        values["shared_expert_gate"] = values["shared_expert_intermediate_size"] > 0
        values.update(options)
        return cls(**values)
