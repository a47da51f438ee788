"""Mixture of experts with expert parallelism.

    layer = MoELayer(MoEConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, top_k=k), topology)
    y = layer(x)                                   # x (B, S, H) -> (B, S, H)
    loss = lm_loss + auxiliary_loss(model)          # aux_loss_coef * aux + z_loss_coef * z
    update_expert_biases(model)                     # after optimizer.step, aux-loss-free balancing

`TopKRouter` (router), `AllToAllDispatcher` / `AllGatherDispatcher` (token dispatch over ep),
`GroupedExperts` (the local experts as fused tensors, one batched matmul), `MoELayer` composing
them; `checkpoint` reads and writes the three expert layouts of Hugging Face files.
"""

from mm_parallel.moe import checkpoint, token_layout
from mm_parallel.moe.config import MoEConfig
from mm_parallel.moe.dispatch import AllGatherDispatcher, AllToAllDispatcher
from mm_parallel.moe.experts import GroupedExperts
from mm_parallel.moe.layer import (
    MoELayer,
    auxiliary_loss,
    load_balancing_loss,
    moe_layers,
    router_z_loss,
    routing_metrics,
    update_expert_biases,
)
from mm_parallel.moe.router import Routing, TopKRouter

__all__ = [
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "GroupedExperts",
    "MoEConfig",
    "MoELayer",
    "Routing",
    "TopKRouter",
    "auxiliary_loss",
    "checkpoint",
    "load_balancing_loss",
    "moe_layers",
    "router_z_loss",
    "routing_metrics",
    "token_layout",
    "update_expert_biases",
]
