"""CogVideoX's expert-adaptive block: the architecture of diffusers' CogVideoXBlock.

Text and video tokens travel as one joint sequence x = [text ; video] (B, T + S, D), as diffusers
concatenates them in attention and the feed-forward. Each stream has its own adaptive LayerNorm
modulation from the time embedding (diffusers' CogVideoXLayerNormZero: one LayerNorm, six vectors
from linear(silu(temb))), here applied per token:

    m = [shift, scale, gate] of the token's stream  (text: enc_shift, enc_scale, enc_gate)
    x += m.gate * Attn(LN1(x) * (1 + m.scale) + m.shift)      q / k LayerNorm per head,
                                                               RoPE on the video rows only
    x += m'.gate * FF(LN2(x) * (1 + m'.scale) + m'.shift)     GELU (tanh) MLP

Carrying the joint sequence keeps a later split of it (sequence / context parallel) to one rule:
a rank's rows are text rows then video rows, and the per-token vectors are tiled to match.
Rotary tables come for the video rows; the text rows get cos = 1, sin = 0, which leaves them
exactly unchanged. Under tensor parallelism the heads and the MLP's features are split (q/k/v and
net.0 by columns, to_out and net.2 by rows); the per-head q / k norms are shared by all heads, so
a tp rank's gradient for them is partial and summed over tp.
"""

from __future__ import annotations

from mindspore import nn, ops

from mm_models_video.cogvideox.config import CogVideoXTransformerConfig
from mm_parallel import ops as kernels
from mm_parallel.blocks import FeedForward, Identity, Indexed, LayerNorm, Linear
from mm_parallel.ops.device import tiled_to
from mm_parallel.recompute import CoreAttention
from mm_parallel.sharding import mark_partial_over_tp
from mm_parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from mm_parallel.topology import Topology


def per_token(text_vector, video_vector, text_rows: int, video_rows: int, dim: int):
    """(B, text_rows + video_rows, D): each stream's (B, 1, D) vector tiled over its rows."""
    batch = text_vector.shape[0]
    parts = []
    if text_rows:
        parts.append(tiled_to(text_vector, (batch, text_rows, dim)))
    if video_rows:
        parts.append(tiled_to(video_vector, (batch, video_rows, dim)))
    return parts[0] if len(parts) == 1 else ops.concat(parts, 1)


class LayerNormZero(nn.Cell):
    """diffusers' CogVideoXLayerNormZero: LN(x) modulated per stream; returns it and the gates."""

    def __init__(self, config: CogVideoXTransformerConfig):
        super().__init__()
        dim = config.inner_dim
        self.linear = Linear(config.time_embed_dim, 6 * dim)
        self.norm = LayerNorm(dim, config.norm_eps, config.norm_elementwise_affine)

    def construct(self, x, temb, text_rows: int):
        dim = x.shape[-1]
        video_rows = x.shape[1] - text_rows
        mods = ops.split(self.linear(ops.silu(temb))[:, None, :], dim, 2)
        shift, scale, gate = (per_token(mods[3 + i], mods[i], text_rows, video_rows, dim) for i in range(3))
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
            mark_partial_over_tp(self.norm_q.weight, self.norm_q.bias, self.norm_k.weight, self.norm_k.bias)
        self.core_attention = CoreAttention(topology=topology)

    def _heads(self, x):
        return x.reshape(x.shape[0], x.shape[1], self.heads, self.head_dim)

    def construct(self, x, cos=None, sin=None):
        q = self.norm_q(self._heads(self.to_q(x)))
        k = self.norm_k(self._heads(self.to_k(x)))
        v = self._heads(self.to_v(x))
        if cos is not None:
            q, k = kernels.apply_rotary(q, cos, sin, True), kernels.apply_rotary(k, cos, sin, True)
        out = self.core_attention(q, k, v)
        return self.to_out[0](out.reshape(out.shape[0], out.shape[1], -1))


class CogVideoXBlock(nn.Cell):
    def __init__(self, config: CogVideoXTransformerConfig, topology: Topology):
        super().__init__()
        dim = config.inner_dim
        self.norm1 = LayerNormZero(config)
        self.attn1 = CogVideoXAttention(config, topology)
        self.norm2 = LayerNormZero(config)
        self.ff = FeedForward(dim, 4 * dim, act="gelu_pytorch_tanh", topology=topology)

    def construct(self, x, temb, text_rows: int, cos=None, sin=None):
        hidden, gate = self.norm1(x, temb, text_rows)
        x = x + gate * self.attn1(hidden, cos, sin)
        hidden, gate = self.norm2(x, temb, text_rows)
        return x + gate * self.ff(hidden)
