"""T5 and UMT5 text encoders (encoder only): the MindSpore twins of transformers'
T5EncoderModel (v1.1, CogVideoX's t5-v1_1-xxl) and UMT5EncoderModel (Wan2.1's umt5-xxl).

    h = shared[input_ids]
    layer:  h += o(attention(q(n), k(n), v(n), bias = rel_bias[bucket(j - i)], no 1/sqrt(d))),  n = rms(h)
            h += wo(gelu_tanh(wi_0(n)) * wi_1(n)),   n = rms(h)          ("gated-gelu")
    out = rms(h)

The two differ in one thing: T5's relative-position table lives in the first layer and its bias
serves every layer; UMT5 gives each layer its own table. Parameter names are transformers'
(``shared.weight``, ``encoder.block.0.layer.0.SelfAttention.q.weight``,
``encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight``,
``encoder.block.0.layer.1.DenseReluDense.wi_0.weight`` ...). The encoder is replicated on every
rank (it is frozen in training and small next to the DiT); padding keys are masked by
``attention_mask``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from mindspore import Tensor, nn, ops

from mm_parallel import ops as kernels
from mm_parallel.blocks import Indexed, Linear, RMSNorm, activation
from mm_parallel.hf_checkpoint import load_weights, save_module
from mm_parallel.tensor_parallel import new_parameter


@dataclass
class EncoderOutput:
    last_hidden_state: Tensor


def relative_position_buckets(query_length: int, key_length: int, num_buckets: int, max_distance: int) -> np.ndarray:
    """(q, k) bucket of each key offset j - i for a bidirectional encoder, in T5's float32 arithmetic:
    half the buckets per direction, exact for small offsets, log-spaced up to max_distance."""
    relative = np.arange(key_length)[None, :] - np.arange(query_length)[:, None]
    half = num_buckets // 2
    buckets = (relative > 0).astype(np.int64) * half
    distance = np.abs(relative)
    max_exact = half // 2
    # offsets below max_exact take the exact bucket below; log of them (0 included) is never used
    ratio = np.log(np.maximum(distance, max_exact).astype(np.float32) / np.float32(max_exact)) / \
        np.float32(math.log(max_distance / max_exact))
    large = max_exact + (ratio * np.float32(half - max_exact)).astype(np.int64)
    large = np.minimum(large, half - 1)
    return buckets + np.where(distance < max_exact, distance, large)


class T5Attention(nn.Cell):
    """Self-attention with a relative-position bias; ``has_table``: this layer holds a table."""

    def __init__(self, config, has_table: bool):
        super().__init__()
        self.heads, self.head_dim = config.num_heads, config.d_kv
        inner = self.heads * self.head_dim
        self.q = Linear(config.d_model, inner, bias=False)
        self.k = Linear(config.d_model, inner, bias=False)
        self.v = Linear(config.d_model, inner, bias=False)
        self.o = Linear(inner, config.d_model, bias=False)
        self.relative_attention_bias = None
        if has_table:
            self.relative_attention_bias = nn.Cell()
            buckets = config.relative_attention_num_buckets
            self.relative_attention_bias.weight = new_parameter((buckets, self.heads), "weight", None, None)

    def position_bias(self, buckets):
        """(1, heads, q, k): the table's entry of each query-key bucket."""
        return ops.gather(self.relative_attention_bias.weight, buckets, 0).transpose(2, 0, 1)[None]

    def construct(self, x, bias, key_padding_mask=None):
        b, s = x.shape[0], x.shape[1]
        q, k, v = (proj(x).reshape(b, s, self.heads, self.head_dim) for proj in (self.q, self.k, self.v))
        out = kernels.attention(q, k, v, scale=1.0, bias=bias, key_padding_mask=key_padding_mask)
        return self.o(out.reshape(b, s, -1))


class _SelfAttentionLayer(nn.Cell):
    def __init__(self, config, has_table: bool):
        super().__init__()
        self.SelfAttention = T5Attention(config, has_table)
        self.layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)

    def construct(self, x, bias, key_padding_mask=None):
        return x + self.SelfAttention(self.layer_norm(x), bias, key_padding_mask)


class _GatedFeedForward(nn.Cell):
    def __init__(self, config):
        super().__init__()
        self.wi_0 = Linear(config.d_model, config.d_ff, bias=False)
        self.wi_1 = Linear(config.d_model, config.d_ff, bias=False)
        self.wo = Linear(config.d_ff, config.d_model, bias=False)
        self.act = activation(config.dense_act_fn)

    def construct(self, x):
        return self.wo(self.act(self.wi_0(x)) * self.wi_1(x))


class _FeedForwardLayer(nn.Cell):
    def __init__(self, config):
        super().__init__()
        if not config.is_gated_act:
            raise ValueError(f"feed_forward_proj={config.feed_forward_proj!r}: only the gated form T5 v1.1 and "
                             "UMT5 use ('gated-gelu') is supported")
        self.DenseReluDense = _GatedFeedForward(config)
        self.layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)

    def construct(self, x):
        return x + self.DenseReluDense(self.layer_norm(x))


class T5Block(nn.Cell):
    def __init__(self, config, has_table: bool):
        super().__init__()
        self.layer = Indexed(_SelfAttentionLayer(config, has_table), _FeedForwardLayer(config))

    def construct(self, x, bias, key_padding_mask=None):
        return self.layer[1](self.layer[0](x, bias, key_padding_mask))


class _Stack(nn.Cell):
    def __init__(self, config, every_layer_has_table: bool):
        super().__init__()
        self.block = nn.CellList([T5Block(config, every_layer_has_table or i == 0) for i in range(config.num_layers)])
        self.final_layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)


class _T5StyleEncoder(nn.Cell):
    """See the module docstring. ``from_pretrained(path)`` reads a transformers folder."""

    config_class_name = ""  # transformers' config class
    architecture = ""
    every_layer_has_table = False

    def __init__(self, config):
        super().__init__()
        config_class = self.config_class()
        self.config = config if isinstance(config, config_class) else config_class(**config)
        self.shared = nn.Cell()
        self.shared.weight = new_parameter((self.config.vocab_size, self.config.d_model), "weight", 1.0, None)
        self.encoder = _Stack(self.config, self.every_layer_has_table)

    @classmethod
    def config_class(cls):
        import transformers

        return getattr(transformers, cls.config_class_name)

    @classmethod
    def from_pretrained(cls, path, topology=None):
        model = cls(cls.config_class().from_pretrained(str(path)))
        # the embedding is saved as shared.weight (encoder.embed_tokens.weight is tied to it)
        load_weights(model, str(path), lambda name: (name, "encoder.embed_tokens.weight") if name == "shared.weight"
                     else name)
        return model

    def save_pretrained(self, path) -> None:
        """Write the transformers folder (config.json, model.safetensors) that transformers'
        encoder class loads (tested; the embedding as shared.weight, which it ties to
        encoder.embed_tokens); one process writes."""
        save_module(self, path, {**self.config.to_dict(), "architectures": [self.architecture]})

    def construct(self, input_ids, attention_mask=None) -> EncoderOutput:
        ids = input_ids.asnumpy() if isinstance(input_ids, Tensor) else np.asarray(input_ids)
        cfg = self.config
        buckets = Tensor(relative_position_buckets(ids.shape[1], ids.shape[1], cfg.relative_attention_num_buckets,
                                                   cfg.relative_attention_max_distance).astype(np.int32))
        mask = None
        if attention_mask is not None:
            mask = np.asarray(attention_mask.asnumpy() if isinstance(attention_mask, Tensor) else attention_mask)
            mask = None if mask.all() else Tensor(mask.astype(np.float32))
        x = ops.gather(self.shared.weight, Tensor(ids.astype(np.int32)), 0)
        bias = None
        for block in self.encoder.block:
            attention = block.layer[0].SelfAttention
            if attention.relative_attention_bias is not None:  # T5: the first layer's serves them all
                bias = attention.position_bias(buckets)
            x = block(x, bias, mask)
        return EncoderOutput(last_hidden_state=self.encoder.final_layer_norm(x))


class T5EncoderModel(_T5StyleEncoder):
    """transformers' T5EncoderModel (v1.1: gated-gelu, untied head irrelevant to the encoder)."""

    config_class_name, architecture = "T5Config", "T5EncoderModel"


class UMT5EncoderModel(_T5StyleEncoder):
    """transformers' UMT5EncoderModel: a relative-position table in every layer."""

    config_class_name, architecture, every_layer_has_table = "UMT5Config", "UMT5EncoderModel", True


def t5_encoder_flops(config: dict, tokens: int) -> int:
    """Forward FLOPs (matrix products) of a T5 / UMT5 encoder over one sequence of ``tokens``
    (``config``: its config.json fields): per layer q / k / v / o, the scores and the weighted
    values of every head, and the feed-forward (gated: wi_0, wi_1, wo)."""
    from mm_profiling.flops import matmul

    d, inner, ff = config["d_model"], config["num_heads"] * config["d_kv"], config["d_ff"]
    gated = config.get("feed_forward_proj", "relu").startswith("gated")
    per_layer = (4 * matmul(tokens, d, inner) + 2 * config["num_heads"] * matmul(tokens, config["d_kv"], tokens)
                 + (3 if gated else 2) * matmul(tokens, d, ff))
    return config["num_layers"] * per_layer
