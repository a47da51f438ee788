"""`MoELayer`: router, capacity, dispatcher, grouped experts and an optional shared expert; and
the losses and metrics read from what its routers saw.

Layout of the tokens (B, S, H) a layer receives, by parallel layout:
    tp = 1, or tp > 1 without sequence parallelism: every tp rank holds the same tokens
    sequence parallel, expert_tp = tp: the tokens are all-gathered over tp (backward: split),
        routed alike on every tp rank, each expert a tensor-parallel MLP; the output is cut back
    sequence parallel, expert_tp = 1: each tp rank routes its own part of the sequence to whole
        experts; the router's and the experts' gradients are partial over tp (summed there)
Context parallel ranks route their own parts of a sample. The shared expert is a GatedMLP on the
layer's input as received (sequence parallel inside it, as any MLP).

Routing statistics, per layer, over the ranks that hold one sample's tokens (cp, and tp when the
tokens are split over it) and the tokens ``token_mask`` marks (transformers' attention mask; each
rank passes the part for the tokens it holds, gathered with them when they are gathered):
    v = [sum_t p_t (E) | count_e (E) | rows | sum_t lse_t^2]      one matmul mask (1, T) @ [...]
summed over those ranks in forward (identity backward: each rank differentiates its own tokens).
Over the model's layers l (transformers' load_balancing_loss_func, which pools the layers):
    aux  = E sum_e (sum_l count_le / sum_l rows_l) (sum_l psum_le / sum_l rows_l)
    z    = sum_l (sum_t lse_lt^2) / rows_l        (ST-MoE router z-loss, lse = logsumexp(logits))
The model adds aux_loss_coef * aux + z_loss_coef * z to its loss.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mm_parallel import comm, mappings
from mm_parallel.blocks import GatedMLP, Linear
from mm_parallel.moe.config import MoEConfig
from mm_parallel.moe.dispatch import DISPATCHERS
from mm_parallel.moe.experts import GroupedExperts
from mm_parallel.moe.router import TopKRouter
from mm_parallel.moe.token_layout import capacity, capacity_keep
from mm_parallel.sharding import mark_partial_over_tp
from mm_parallel.topology import Topology, get_topology


class MoELayer(nn.Cell):
    """A sparse MoE block with transformers' names: ``gate`` (router), ``experts``, and
    ``shared_expert`` / ``shared_expert_gate`` when configured. ``construct(hidden_states,
    token_mask=None)`` returns the output, shaped as the input; the routing statistics of that
    forward are in ``self.stats`` (see the module docstring). A cell that is recomputed
    (Cell.recompute) and holds a MoELayer must return ``stats`` as an output: read only as an
    attribute, its gradient is lost in the recomputed backward (measured, MindSpore 2.7.2)."""

    def __init__(self, config: MoEConfig, topology: Optional[Topology] = None, init_std: Optional[float] = None):
        super().__init__()
        topo = self.topology = get_topology(topology)
        self.config = config
        split_tokens = topo.tp.size > 1 and topo.config.sequence_parallel
        self.gather_tokens = split_tokens and topo.config.expert_tp_size > 1
        self.tokens_split_over_tp = split_tokens and not self.gather_tokens
        self.gate = TopKRouter(config, init_std)
        self.experts = GroupedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                      config.hidden_act, topology=topo, init_std=init_std)
        if self.tokens_split_over_tp:
            for param in (self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj):
                mark_partial_over_tp(param)
        self.gate.tokens_split_over_tp = self.tokens_split_over_tp
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size,
                                          config.hidden_act, topology=topo, init_std=init_std)
            if config.shared_expert_gate:
                self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False, init_std=init_std)
                if split_tokens:  # it sees the layer's input, a sequence shard under sequence parallelism
                    mark_partial_over_tp(self.shared_expert_gate.weight)
        self.dispatcher = DISPATCHERS[config.dispatcher](config.num_experts, topo)
        self.stats = None
        self.history = _History(config.num_experts)

    def construct(self, hidden_states, token_mask=None):
        cfg, topo = self.config, self.topology
        seq_dim = hidden_states.ndim - 2
        x = hidden_states
        if self.gather_tokens:
            x = mappings.gather_from_sequence(x, topo.tp, seq_dim, grad_reduce_scatter=False)
            if token_mask is not None:  # the mask of the gathered tokens: every tp rank's part, in order
                local = _host_mask(token_mask).reshape(hidden_states.shape[:-1])
                token_mask = comm.all_gather(Tensor(local), topo.tp, seq_dim).asnumpy()
        flat = x.reshape(-1, cfg.hidden_size)
        routing = self.gate(flat)
        pad_to = None
        if cfg.capacity_factor is not None:
            pad_to = capacity(flat.shape[0], cfg.top_k, cfg.num_experts, cfg.capacity_factor)
            routing.keep = capacity_keep(routing.experts, routing.weights.asnumpy(), cfg.num_experts, pad_to,
                                         cfg.drop_policy)
        self.stats = self._statistics(routing, token_mask, flat.shape[0])
        self.history.add(routing)
        tokens, groups, state = self.dispatcher.dispatch(flat, routing, pad_to if cfg.pad_to_capacity else None)
        y = self.dispatcher.combine(self.experts(tokens, groups), state).reshape(x.shape)
        if self.gather_tokens:
            y = mappings.scatter_to_sequence(y, topo.tp, seq_dim)
        if self.shared_expert is not None:
            shared = self.shared_expert(hidden_states)
            if self.shared_expert_gate is not None:
                shared = ops.sigmoid(self.shared_expert_gate(hidden_states)) * shared
            y = y + shared
        return y

    def _statistics(self, routing, token_mask, tokens: int):
        """The layer's statistics vector (module docstring), summed over one sample's ranks."""
        cfg = self.config
        mask = np.ones((1, tokens), np.float32) if token_mask is None else _mask_row(token_mask, tokens)
        chosen = np.zeros((tokens, cfg.num_experts), np.float32)
        np.add.at(chosen, (np.repeat(np.arange(tokens), cfg.top_k), routing.experts.reshape(-1)), 1.0)
        logits = routing.logits
        top = ops.stop_gradient(ops.amax(logits, -1, True))  # Tensor.max reads the host
        lse = ops.log(ops.exp(logits - top).sum(-1, keepdims=True)) + top
        columns = ops.concat([routing.probs, Tensor(chosen), Tensor(np.ones((tokens, 1), np.float32)), lse * lse], 1)
        stats = ops.matmul(Tensor(mask), columns).reshape(-1)
        if self.tokens_split_over_tp:
            stats = mappings.reduce_from_region(stats, self.topology.tp)
        if self.topology.cp.size > 1:
            stats = mappings.reduce_from_region(stats, self.topology.cp)
        return stats


def _host_mask(token_mask) -> np.ndarray:
    return np.asarray(token_mask.asnumpy() if isinstance(token_mask, Tensor) else token_mask, np.float32)


def _mask_row(token_mask, tokens: int) -> np.ndarray:
    mask = _host_mask(token_mask)
    if mask.size != tokens:
        raise ValueError(f"token_mask has {mask.size} entries for {tokens} tokens; pass this rank's part of the "
                         "attention mask, shaped as the layer's tokens")
    return mask.reshape(1, tokens)


def moe_layers(model: nn.Cell) -> List[MoELayer]:
    """The MoE layers of a model, in module order."""
    return [cell for _, cell in model.cells_and_names() if isinstance(cell, MoELayer)]


def load_balancing_loss(stats: Sequence[Tensor], num_experts: int):
    """transformers' load_balancing_loss_func over the layers' statistics vectors (module docstring)."""
    total = ops.stack(list(stats)).sum(0) if len(stats) > 1 else stats[0]
    rows = total[2 * num_experts]
    return (total[:num_experts] * ops.stop_gradient(total[num_experts:2 * num_experts])).sum() / (rows * rows) \
        * num_experts


def router_z_loss(stats: Sequence[Tensor], num_experts: int):
    """sum over layers of mean_t logsumexp(logits_t)^2."""
    return sum(s[2 * num_experts + 1] / s[2 * num_experts] for s in stats)


def auxiliary_loss(model_or_layers, config: Optional[MoEConfig] = None):
    """aux_loss_coef * aux + z_loss_coef * z over the MoE layers' last forward (a scalar tensor, 0
    without MoE layers)."""
    layers = model_or_layers if isinstance(model_or_layers, (list, tuple)) else moe_layers(model_or_layers)
    if not layers:
        return Tensor(0.0, ms.float32)
    cfg = config or layers[0].config
    stats = [layer.stats for layer in layers]
    loss = Tensor(0.0, ms.float32)
    if cfg.aux_loss_coef:
        loss = loss + cfg.aux_loss_coef * load_balancing_loss(stats, cfg.num_experts)
    if cfg.z_loss_coef:
        loss = loss + cfg.z_loss_coef * router_z_loss(stats, cfg.num_experts)
    return loss


class _History:
    """Host counts since the last `routing_metrics`: slots per expert, dropped slots, forwards."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.reset()

    def reset(self):
        self.counts, self.dropped, self.slots, self.forwards = np.zeros(self.num_experts), 0, 0, 0

    def add(self, routing):
        kept = routing.experts if routing.keep is None else routing.experts[routing.keep]
        self.counts = self.counts + np.bincount(kept.reshape(-1), minlength=self.num_experts)
        self.slots += routing.experts.size
        self.dropped += 0 if routing.keep is None else int((~routing.keep).sum())
        self.forwards += 1


def routing_metrics(model: nn.Cell, reset: bool = True, names: Callable[[str], str] = lambda name: name) \
        -> Dict[str, Dict[str, object]]:
    """{layer's module path (``names`` maps it, e.g. to the whole model's numbering; "moe" for a
    bare layer): figures} over this rank's tokens since the last call: tokens per expert per
    forward, imbalance max / mean, dropped fraction; and the last forward's aux and z losses.
    Forwards run again by recomputation count as often as they ran, which averages out of every
    figure here."""
    out = {}
    for path, layer in model.cells_and_names():
        if not isinstance(layer, MoELayer) or not layer.history.forwards:
            continue
        h, cfg = layer.history, layer.config
        per_forward = h.counts / h.forwards
        mean = per_forward.mean()
        entry = {"tokens_per_expert": [round(float(c), 2) for c in per_forward],
                 "imbalance": float(per_forward.max() / mean) if mean else 0.0,
                 "dropped_fraction": h.dropped / h.slots if h.slots else 0.0}
        if layer.stats is not None:
            entry["aux_loss"] = float(load_balancing_loss([layer.stats], cfg.num_experts).asnumpy())
            entry["z_loss"] = float(router_z_loss([layer.stats], cfg.num_experts).asnumpy())
        out[names(path) if path else "moe"] = entry
        if reset:
            h.reset()
    return out


def update_expert_biases(model: nn.Cell) -> None:
    """Aux-loss-free balancing after an optimizer step: every router with an expert bias moves it by
    its load over the step, counted over all replicas of the router (one all-reduce)."""
    routers = [layer.gate for layer in moe_layers(model) if layer.gate.expert_bias is not None]
    if not routers:
        return
    topo = get_topology(getattr(model, "topology", None))
    loads = Tensor(np.concatenate([r.load for r in routers]).astype(np.float32))
    loads = comm.all_reduce(loads, topo.dp_cp)
    if routers[0].tokens_split_over_tp:
        loads = comm.all_reduce(loads, topo.tp)
    loads = loads.asnumpy().reshape(len(routers), -1)
    for router, load in zip(routers, loads):
        router.update_bias(load)
