"""Qwen3-VL language model: Qwen2.5-VL's decoder with q / k RMSNorms, configurable attention bias
and head_dim, DeepStack inputs and, for Qwen3-VL-MoE, sparse MoE layers.

    h = h + attn(norm(h));  h = h + mlp(norm(h))       per layer, as Qwen2.5-VL
    h = h + deepstack_l     after global layer l < len(deepstack): the l-th DeepStack features,
                            already scattered to the visual positions (zeros elsewhere) and cut
                            like the sequence, so the addition is local under sp / cp

The q / k norms act on one head's features; under tensor parallelism each rank holds some heads,
so their gradients are partial over tp (summed there). An MoE layer (`mm_parallel.moe.MoELayer`,
transformers' router: fp32 softmax, top-k, renormalised) replaces the MLP of layer l unless l is
in ``mlp_only_layers`` or (l + 1) is not a multiple of ``decoder_sparse_step``.
"""

from __future__ import annotations

from typing import Dict, Optional

from mindspore import nn

from mm_models_vl.qwen2_5_vl.language import Qwen2_5_VLAttention, Qwen2_5_VLTextModel
from mm_parallel.blocks import GatedMLP, RMSNorm
from mm_parallel.moe import MoEConfig, MoELayer
from mm_parallel.sequence_parallel import mark_sequence_parallel
from mm_parallel.sharding import mark_partial_over_tp
from mm_parallel.topology import Topology


def is_sparse_layer(config, layer_idx: int) -> bool:
    """transformers' rule for which decoder layers of a Qwen3-VL-MoE text config are MoE layers."""
    experts = getattr(config, "num_experts", 0) or 0
    return experts > 0 and layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and \
        (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0


class Qwen3VLTextAttention(Qwen2_5_VLAttention):
    def __init__(self, config, layer_idx: int, topology: Topology):
        super().__init__(config, layer_idx, topology, bias=config.attention_bias, o_bias=config.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        if topology.tp.size > 1:  # each tp rank normalises its own heads
            mark_partial_over_tp(self.q_norm.weight)
            mark_partial_over_tp(self.k_norm.weight)

    def normalize_qk(self, q, k):
        return self.q_norm(q), self.k_norm(k)


class Qwen3VLTextDecoderLayer(nn.Cell):
    def __init__(self, config, layer_idx: int, topology: Topology):
        super().__init__()
        self.self_attn = Qwen3VLTextAttention(config, layer_idx, topology)
        self.is_sparse = is_sparse_layer(config, layer_idx)
        if self.is_sparse:
            self.mlp = MoELayer(MoEConfig.from_hf(config), topology)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, topology=topology)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if topology.config.sequence_parallel and topology.tp.size > 1:  # each tp rank sees part of the sequence
            mark_sequence_parallel(self.input_layernorm.weight, self.post_attention_layernorm.weight)

    def construct(self, x, cos, sin, key_padding_mask=None, cache=None, token_mask=None, segment_ids=None):
        """The new hidden states; an MoE layer also returns its routing statistics, as an output
        rather than only the attribute ``mlp.stats``, so that a recomputed layer differentiates them."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, key_padding_mask, cache, segment_ids)
        h = self.post_attention_layernorm(x)
        if self.is_sparse:
            return x + self.mlp(h, token_mask=token_mask), self.mlp.stats
        return x + self.mlp(h)


class Qwen3VLTextModel(Qwen2_5_VLTextModel):
    """Embedding (first stage), decoder layers [first, last), final norm (last stage), DeepStack.
    After a forward, ``moe_stats`` holds the routing statistics of its MoE layers, in order."""

    layer_class = Qwen3VLTextDecoderLayer

    def construct(self, x, cos, sin, key_padding_mask=None, cache=None, deepstack: Optional[Dict] = None,
                  token_mask=None, segment_ids=None):
        """``deepstack``: {global layer number: the features added after that layer};
        ``segment_ids``: a packed row's sample numbers."""
        deepstack, self.moe_stats = deepstack or {}, []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, key_padding_mask, cache, token_mask, segment_ids)
            if layer.is_sparse:
                x, stats = x
                self.moe_stats.append(stats)
            if self.layer_offset + i in deepstack:
                x = x + deepstack[self.layer_offset + i]
        return x if self.norm is None else self.norm(x)
