"""`TopKRouter`: which k experts each token goes to, and with what weights.

    logits = x W^T                     W (E, H), computed in fp32 (transformers casts the softmax to fp32)
    p      = softmax(logits)           over all E experts
    softmax_topk:  S = top-k of (p + b),        w = p[S]  (/ sum_S p when norm_topk_prob)
    topk_softmax:  S = top-k of (logits + b),   w = softmax(logits[S])

b is the aux-loss-free expert bias (zero unless ``expert_bias``): it moves the choice of experts
only, never the weights (DeepSeek-V3), and is not trained by the gradient: after each optimizer
step `update_bias` adds rate * sign(mean load - load_e), the loads counted over the step's tokens
on every replica of the router. The choice S has no gradient (top-k is piecewise constant); the
weights carry the gradient back to W through p.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mm_parallel import census
from mm_parallel.moe.config import MoEConfig
from mm_parallel.precision import keep_in_fp32
from mm_parallel.tensor_parallel import new_parameter


@dataclass
class Routing:
    """One forward's routing: ``logits`` and ``probs`` (T, E) fp32 tensors, ``weights`` (T, k)
    tensor, ``experts`` (T, k) host ints, ``keep`` (T, k) host bools (None: every slot kept)."""

    logits: Tensor
    probs: Tensor
    weights: Tensor
    experts: np.ndarray
    keep: Optional[np.ndarray] = None


class TopKRouter(nn.Cell):
    """transformers' ``mlp.gate``: a linear gate ``weight`` (E, H), no bias; see the module docstring."""

    def __init__(self, config: MoEConfig, init_std: Optional[float] = None):
        super().__init__()
        self.config = config
        self.weight = new_parameter((config.num_experts, config.hidden_size), "weight", init_std, None)
        self.expert_bias = None
        if config.expert_bias:
            self.expert_bias = keep_in_fp32(census.filled((config.num_experts,), "expert_bias", 0.0,
                                                             requires_grad=False))
        self.load = np.zeros(config.num_experts, np.float64)  # slots per expert since the last bias update

    def read_hf_tensor(self, folder, keys, attr: str):
        """The expert bias starts at zero when a checkpoint has none (transformers' files don't);
        every other tensor is read as usual (None)."""
        if attr == "expert_bias" and not any(k in folder for k in keys):
            return np.zeros(self.config.num_experts, np.float32)
        return None

    def construct(self, x) -> Routing:
        cfg = self.config
        logits = ops.matmul(x.astype(ms.float32), self.weight.astype(ms.float32).T)
        probs = ops.softmax(logits, -1)
        scores = probs if cfg.score_order == "softmax_topk" else logits
        if self.expert_bias is not None:
            scores = scores + self.expert_bias
        _, chosen = ops.topk(ops.stop_gradient(scores), cfg.top_k)
        if cfg.score_order == "softmax_topk":
            weights = ops.gather_elements(probs, 1, chosen)
            if cfg.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdims=True)
        else:
            weights = ops.softmax(ops.gather_elements(logits, 1, chosen), -1)
        experts = chosen.asnumpy().astype(np.int64)
        self.load += np.bincount(experts.reshape(-1), minlength=cfg.num_experts)
        return Routing(logits, probs, weights.astype(x.dtype), experts)

    def update_bias(self, load: np.ndarray) -> None:
        """b_e += rate * sign(mean(load) - load_e) (``load``: the step's slots per expert over every
        replica of this router); the count restarts."""
        if self.expert_bias is None:
            return
        step = self.config.bias_update_rate * np.sign(load.mean() - load)
        self.expert_bias.set_data(Tensor((self.expert_bias.asnumpy() + step).astype(np.float32)))
        self.load[:] = 0
