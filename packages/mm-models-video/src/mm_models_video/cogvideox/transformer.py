"""CogVideoX's expert-adaptive block: the architecture of diffusers' CogVideoXBlock.

Text and video tokens travel as one joint sequence x = [text ; video] (B, T + S, D), as diffusers
concatenates them in attention and the feed-forward. Each stream has its own adaptive LayerNorm
modulation from the time embedding (diffusers' CogVideoXLayerNormZero: one LayerNorm, six vectors
from linear(silu(temb))), here applied per token:

    m = [shift, scale, gate] of the token's stream  (text: enc_shift, enc_scale, enc_gate)
    x += m.gate * Attn(LN1(x) * (1 + m.scale) + m.shift)      q / k LayerNorm per head,
                                                               RoPE on the video rows only
    x += m'.gate * FF(LN2(x) * (1 + m'.scale) + m'.shift)     GELU (tanh) MLP

Carrying the joint sequence makes its split over ranks (context parallel zigzag, sequence
parallel chunks) one rule: a rank knows which of its rows are text (``streams``) and gathers each
row's vectors from the [video, text] pair. Rotary tables come for the video rows; the text rows
get cos = 1, sin = 0, which leaves them exactly unchanged. Under tensor parallelism the heads and
the MLP's features are split (q/k/v and net.0 by columns, to_out and net.2 by rows); the per-head
q / k norms are shared by all heads, so a tp rank's gradient for them is partial and summed over
tp; under sequence parallelism so are the modulation's and the LayerNorms', used on a shard.
"""

from __future__ import annotations

from mindspore import nn, ops

from mm_models_video.cogvideox.config import CogVideoXTransformerConfig
from mm_parallel import ops as kernels
from mm_parallel.blocks import FeedForward, Identity, Indexed, LayerNorm, Linear
from mm_parallel.recompute import CoreAttention
from mm_parallel.sharding import mark_partial_over_tp
from mm_parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from mm_parallel.topology import Topology


def per_row(vectors, streams):
    """(B, rows, D): row i gets ``vectors[:, streams[i]]`` of the (B, 2, D) [video, text] pair."""
    return ops.gather(vectors, streams, 1)


class LayerNormZero(nn.Cell):
    """diffusers' CogVideoXLayerNormZero: LN(x) modulated per stream; returns it and the gates.
    ``streams`` (rows,) int32: 1 for a text row, 0 for a video row of this rank's x."""

    def __init__(self, config: CogVideoXTransformerConfig, topology: Topology):
        super().__init__()
        dim = config.inner_dim
        self.linear = Linear(config.time_embed_dim, 6 * dim)
        self.norm = LayerNorm(dim, config.norm_eps, config.norm_elementwise_affine)
        if topology.config.sequence_parallel and topology.tp.size > 1:  # used on a sequence shard
            for param in (self.linear.weight, self.linear.bias, self.norm.weight, self.norm.bias):
                if param is not None:
                    mark_partial_over_tp(param)

    def construct(self, x, temb, streams):
        batch, dim = x.shape[0], x.shape[-1]
        # (B, 2, 3, D): [shift, scale, gate] of the video rows, then of the text rows
        mods = self.linear(ops.silu(temb)).reshape(batch, 2, 3, dim)
        shift, scale, gate = (per_row(mods[:, :, i], streams) for i in range(3))
        return self.norm(x) * (scale + 1.0) + shift, gate


class CogVideoXAttention(nn.Cell):
    """Joint self-attention over text + video rows (diffusers' CogVideoXAttnProcessor2_0)."""

    def __init__(self, config: CogVideoXTransformerConfig, topology: Topology):
        super().__init__()
        dim, heads, tp = config.inner_dim, config.num_attention_heads, topology.tp.size
        if heads % tp:
            raise ValueError(f"tp={tp} must divide the attention heads ({heads}); choose tp among its divisors")
        self.heads, self.head_dim = heads // tp, config.attention_head_dim
        args = dict(topology=topology)
        self.to_q = ColumnParallelLinear(dim, dim, config.attention_bias, **args)
        self.to_k = ColumnParallelLinear(dim, dim, config.attention_bias, **args)
        self.to_v = ColumnParallelLinear(dim, dim, config.attention_bias, **args)
        self.norm_q = LayerNorm(self.head_dim, 1e-6)
        self.norm_k = LayerNorm(self.head_dim, 1e-6)
        self.to_out = Indexed(RowParallelLinear(dim, dim, True, **args), Identity())  # [Linear, Dropout]
        if tp > 1:  # shared by the heads, of which a tp rank holds a part
            for param in (self.norm_q.weight, self.norm_q.bias, self.norm_k.weight, self.norm_k.bias):
                mark_partial_over_tp(param)
        self.core_attention = CoreAttention(topology=topology)

    def _heads(self, x):
        return x.reshape(x.shape[0], x.shape[1], self.heads, self.head_dim)

    def construct(self, x, cos=None, sin=None, key_length=None):
        q = self.norm_q(self._heads(self.to_q(x)))
        k = self.norm_k(self._heads(self.to_k(x)))
        v = self._heads(self.to_v(x))
        if cos is not None:
            q, k = kernels.apply_rotary(q, cos, sin, True), kernels.apply_rotary(k, cos, sin, True)
        out = self.core_attention(q, k, v, key_length=key_length)
        return self.to_out[0](out.reshape(out.shape[0], out.shape[1], -1))


class CogVideoXBlock(nn.Cell):
    def __init__(self, config: CogVideoXTransformerConfig, topology: Topology):
        super().__init__()
        dim = config.inner_dim
        self.norm1 = LayerNormZero(config, topology)
        self.attn1 = CogVideoXAttention(config, topology)
        self.norm2 = LayerNormZero(config, topology)
        self.ff = FeedForward(dim, 4 * dim, act="gelu_pytorch_tanh", topology=topology)

    def construct(self, x, temb, streams, cos=None, sin=None, key_length=None):
        hidden, gate = self.norm1(x, temb, streams)
        x = x + gate * self.attn1(hidden, cos, sin, key_length)
        hidden, gate = self.norm2(x, temb, streams)
        return x + gate * self.ff(hidden)
