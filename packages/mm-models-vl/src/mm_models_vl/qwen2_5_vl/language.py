"""Qwen2.5-VL language model: a Qwen2 decoder (GQA with q/k/v bias, SwiGLU, RMSNorm) rotated by M-RoPE.

The layout is fixed at construction, because it decides the parameter shapes: tensor parallel when
the topology has tp > 1 (Megatron layout: q/k/v and gate/up split by columns, o and down by rows,
embedding by vocabulary; with sequence parallelism the residual stream is split on the sequence
over tp), attention through `mm_parallel.attention` (context parallel when cp > 1), and a pipeline
stage builds only its own decoder layers (``layer_offset`` keeps their checkpoint names).
"""

from __future__ import annotations

from typing import Optional

from mindspore import nn, ops

from mm_parallel import ops as kernels
from mm_parallel.blocks import GatedMLP, RMSNorm
from mm_parallel.decoding import KVCache
from mm_parallel.recompute import CoreAttention
from mm_parallel.sequence_parallel import mark_sequence_parallel
from mm_parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from mm_parallel.topology import Topology


class Qwen2_5_VLAttention(nn.Cell):
    """GQA self-attention; q/k/v (``bias``) column-parallel, o (``o_bias``) row-parallel. Subclasses
    may normalise queries and keys before the rotary (`normalize_qk`, Qwen3's q / k norms)."""

    def __init__(self, config, layer_idx: int, topology: Topology, bias: bool = True, o_bias: bool = False):
        super().__init__()
        tp = topology.tp.size
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if heads % tp or kv_heads % tp:
            raise ValueError(
                f"tp={tp} must divide the attention heads ({heads}) and the key/value heads ({kv_heads}); "
                f"choose tp among the divisors of {kv_heads}"
            )
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.local_heads, self.local_kv_heads = heads // tp, kv_heads // tp
        hidden = config.hidden_size
        column = dict(topology=topology)
        self.q_proj = ColumnParallelLinear(hidden, heads * self.head_dim, bias=bias, **column)
        self.k_proj = ColumnParallelLinear(hidden, kv_heads * self.head_dim, bias=bias, **column)
        self.v_proj = ColumnParallelLinear(hidden, kv_heads * self.head_dim, bias=bias, **column)
        self.o_proj = RowParallelLinear(heads * self.head_dim, hidden, bias=o_bias, **column)
        self.core_attention = CoreAttention(causal=True, topology=topology)

    def construct(self, x, cos, sin, key_padding_mask=None, cache: Optional[KVCache] = None, segment_ids=None):
        b = x.shape[0]
        q = self.q_proj(x).reshape(b, -1, self.local_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, -1, self.local_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, -1, self.local_kv_heads, self.head_dim)
        q, k = self.normalize_qk(q, k)
        q, k = kernels.apply_rotary(q, cos, sin), kernels.apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        out = self.core_attention(q, k, v, key_padding_mask, None, segment_ids)
        return self.o_proj(out.reshape(b, q.shape[1], -1))

    def normalize_qk(self, q, k):
        return q, k


class Qwen2_5_VLDecoderLayer(nn.Cell):
    def __init__(self, config, layer_idx: int, topology: Topology):
        super().__init__()
        self.self_attn = Qwen2_5_VLAttention(config, layer_idx, topology)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, topology=topology)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if topology.config.sequence_parallel and topology.tp.size > 1:  # each tp rank sees part of the sequence
            mark_sequence_parallel(self.input_layernorm.weight, self.post_attention_layernorm.weight)

    def construct(self, x, cos, sin, key_padding_mask=None, cache=None, segment_ids=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, key_padding_mask, cache, segment_ids)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2_5_VLTextModel(nn.Cell):
    """Embedding (first stage), decoder layers [first, last) of the stack, final norm (last stage)."""

    layer_class = Qwen2_5_VLDecoderLayer  # (config, layer_idx, topology) -> a decoder layer

    def __init__(self, config, topology: Topology, first: int = 0, last: Optional[int] = None,
                 embed: bool = True, norm: bool = True):
        super().__init__()
        if getattr(config, "use_sliding_window", False):
            raise ValueError("use_sliding_window=True is not supported (no released Qwen2.5-VL checkpoint uses it)")
        rope = config.rope_parameters or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope.get('rope_type')!r} is not supported; Qwen2.5-VL uses 'default' "
                             "(M-RoPE)")
        last = config.num_hidden_layers if last is None else last
        self.layer_offset = first
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, topology=topology,
                                                   sequence_parallel=False) if embed else None
        self.layers = nn.CellList([self.layer_class(config, i, topology) for i in range(first, last)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if norm else None
        if norm and topology.config.sequence_parallel and topology.tp.size > 1:
            mark_sequence_parallel(self.norm.weight)
        self.padding_idx = config.pad_token_id

    def embed(self, input_ids):
        """Token embeddings; as torch's nn.Embedding(padding_idx), the padding row gets no gradient."""
        out = self.embed_tokens(input_ids)
        if self.padding_idx is not None:
            pad = (input_ids == self.padding_idx)[..., None].astype(out.dtype)
            out = out - pad * (out - ops.stop_gradient(out))
        return out

    def construct(self, x, cos, sin, key_padding_mask=None, cache=None, segment_ids=None):
        """``segment_ids``: a packed row's sample numbers (attention stays inside each sample)."""
        for layer in self.layers:
            x = layer(x, cos, sin, key_padding_mask, cache, segment_ids)
        return x if self.norm is None else self.norm(x)


def lm_head(config, topology: Topology) -> ColumnParallelLinear:
    """Vocabulary projection, split by vocabulary rows under tp (logits stay split for the loss);
    with sequence parallelism it gathers the sequence first."""
    return ColumnParallelLinear(config.hidden_size, config.vocab_size, bias=False, topology=topology)
