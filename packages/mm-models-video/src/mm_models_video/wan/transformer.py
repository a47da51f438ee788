"""Wan2.1 diffusion transformer (T2V and I2V): the architecture of diffusers' WanTransformer3DModel.

    video latents (B, C, F, H, W) -> patches -> tokens (B, S, D),  S = F/pt * H/ph * W/pw
    condition: timestep -> sinusoid -> temb (B, D) -> 6 modulation vectors per block; Wan2.2's
               TI2V takes a timestep per token (B, S) (diffusers' expand_timesteps: the clean
               first frame's tokens at 0), embedded once per distinct value and gathered by token
               text embeddings (B, T, text_dim) -> (B, T, D);  I2V: CLIP image tokens -> (B, I, D)
    block:     x += gate * SelfAttn(LN(x) * (1 + scale) + shift)       3-D RoPE, q/k RMSNorm
               x += CrossAttn(LN(x), text)  [+ attention to the image tokens, I2V]
               x += c_gate * FFN(LN(x) * (1 + c_scale) + c_shift)
    out:       LN(x) * (1 + scale) + shift -> proj_out -> unpatchify (B, C_out, F, H, W)

Parameter names are diffusers' (``blocks.3.attn1.to_q.weight``, ``blocks.3.ffn.net.0.proj.weight``,
``condition_embedder.time_proj.weight`` ...). The layout is fixed at construction because it
decides parameter shapes: tensor parallel over heads and FFN features (q/k/v and net.0 by columns,
to_out and net.2 by rows, the q/k norms across heads sum their squares over tp), sequence
parallel (video tokens split over tp between the blocks' matmuls), context parallel self-attention
over the video tokens (cross-attention sees all text), and a pipeline stage builds only its blocks
(``layer_offset`` keeps their checkpoint numbers).

One difference by design: diffusers' I2V attention finds the image tokens by assuming 512 text
tokens (``encoder_hidden_states.shape[1] - 512``); here text and image tokens arrive separately,
so any text length works (with 512 the two agree, which the parity test checks).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from mindspore import Tensor, nn, ops

from mm_models_video.embeddings import TwoLayerMLP, timestep_sinusoid
from mm_models_video.wan.config import WanTransformerConfig
from mm_parallel import census
from mm_parallel import ops as kernels
from mm_parallel.blocks import FeedForward, Identity, Indexed, LayerNorm, Linear, RMSNorm
from mm_parallel.ops.device import tiled_to
from mm_parallel.ops.low_precision import compute_weight
from mm_parallel.recompute import CoreAttention
from mm_parallel.sequence_parallel import mark_sequence_parallel
from mm_parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, new_parameter
from mm_parallel.topology import Topology


def _modulate(x, scale, shift):
    """x * (1 + scale) + shift with (B, 1, D) vectors tiled over the tokens (broadcasting is slow on CPU)."""
    return x * tiled_to(scale + 1.0, x.shape) + tiled_to(shift, x.shape)


def per_token(vectors, token_steps):
    """Modulation vectors (N, 1, D) as they meet the tokens: unchanged (N = the batch, tiled later)
    without per-token timesteps; with them (N = the distinct timesteps) each token's row, gathered
    by ``token_steps`` (B, S) into (B, S, D) (its backward sums the tokens' gradients per timestep)."""
    if token_steps is None:
        return vectors
    return ops.gather(vectors.reshape(vectors.shape[0], vectors.shape[2]), token_steps, 0)


def _sequence_parallel(topology: Topology) -> bool:
    return bool(topology.config.sequence_parallel) and topology.tp.size > 1


class WanAttention(nn.Cell):
    """Self-attention (3-D RoPE, context parallel) or cross-attention to the text and, for I2V,
    separately to the image tokens, whose two outputs are added before to_out."""

    def __init__(self, config: WanTransformerConfig, topology: Topology, cross: bool = False,
                 added_kv_proj_dim: Optional[int] = None):
        super().__init__()
        dim, heads, tp = config.inner_dim, config.num_attention_heads, topology.tp.size
        if heads % tp:
            raise ValueError(f"tp={tp} must divide the attention heads ({heads}); choose tp among its divisors")
        self.cross, self.heads, self.head_dim = cross, heads // tp, config.attention_head_dim
        seq = dict(topology=topology)
        kv = dict(topology=topology, sequence_parallel=False) if cross else seq  # text is never split
        self.to_q = ColumnParallelLinear(dim, dim, True, **seq)
        self.to_k = ColumnParallelLinear(dim, dim, True, **kv)
        self.to_v = ColumnParallelLinear(dim, dim, True, **kv)
        self.to_out = Indexed(RowParallelLinear(dim, dim, True, **seq), Identity())  # [Linear, Dropout]
        norm = dict(split_over_tp=True, topology=topology)
        self.norm_q = RMSNorm(dim, config.eps, **norm)
        self.norm_k = RMSNorm(dim, config.eps, **norm)
        self.add_k_proj = self.add_v_proj = self.norm_added_k = None
        if added_kv_proj_dim is not None:
            self.add_k_proj = ColumnParallelLinear(added_kv_proj_dim, dim, True, **kv)
            self.add_v_proj = ColumnParallelLinear(added_kv_proj_dim, dim, True, **kv)
            self.norm_added_k = RMSNorm(dim, config.eps, **norm)
        # self-attention runs over the (context-parallel) video tokens; cross-attention is local
        self.core_attention = CoreAttention(topology=topology, context_parallel=not cross)

    def _heads(self, x):
        return x.reshape(x.shape[0], x.shape[1], self.heads, self.head_dim)

    def construct(self, x, context=None, context_image=None, cos=None, sin=None):
        source = x if context is None else context
        q = self._heads(self.norm_q(self.to_q(x)))
        k = self._heads(self.norm_k(self.to_k(source)))
        v = self._heads(self.to_v(source))
        if cos is not None:
            q, k = kernels.apply_rotary(q, cos, sin, True), kernels.apply_rotary(k, cos, sin, True)
        out = self.core_attention(q, k, v)
        if context_image is not None:
            k_img = self._heads(self.norm_added_k(self.add_k_proj(context_image)))
            v_img = self._heads(self.add_v_proj(context_image))
            out = out + self.core_attention(q, k_img, v_img)
        return self.to_out[0](out.reshape(out.shape[0], out.shape[1], -1))


class WanTransformerBlock(nn.Cell):
    def __init__(self, config: WanTransformerConfig, topology: Topology):
        super().__init__()
        dim = config.inner_dim
        self.norm1 = LayerNorm(dim, config.eps, elementwise_affine=False)
        self.attn1 = WanAttention(config, topology)
        self.attn2 = WanAttention(config, topology, cross=True, added_kv_proj_dim=config.added_kv_proj_dim)
        self.norm2 = LayerNorm(dim, config.eps) if config.cross_attn_norm else None
        self.ffn = FeedForward(dim, config.ffn_dim, act="gelu_pytorch_tanh", topology=topology)
        self.norm3 = LayerNorm(dim, config.eps, elementwise_affine=False)
        self.scale_shift_table = new_parameter((1, 6, dim), "scale_shift_table", dim ** -0.5, None)
        if _sequence_parallel(topology):  # used on a sequence shard: their gradients are partial
            mark_sequence_parallel(self.scale_shift_table)
            if self.norm2 is not None:
                mark_sequence_parallel(self.norm2.weight, self.norm2.bias)

    def construct(self, x, context, context_image, timestep_proj, cos, sin, token_steps=None):
        vectors = ops.split(tiled_to(compute_weight(self.scale_shift_table), timestep_proj.shape) + timestep_proj, 1, 1)
        shift, scale, gate, c_shift, c_scale, c_gate = (per_token(v, token_steps) for v in vectors)
        x = x + self.attn1(_modulate(self.norm1(x), scale, shift), cos=cos, sin=sin) * tiled_to(gate, x.shape)
        hidden = x if self.norm2 is None else self.norm2(x)
        x = x + self.attn2(hidden, context, context_image)
        return x + self.ffn(_modulate(self.norm3(x), c_scale, c_shift)) * tiled_to(c_gate, x.shape)


class WanImageEmbedding(nn.Cell):
    """CLIP image tokens -> model width: LayerNorm, GELU MLP, LayerNorm (FLF2V: + learned positions)."""

    def __init__(self, in_features: int, out_features: int, pos_embed_seq_len: Optional[int] = None):
        super().__init__()
        self.norm1 = LayerNorm(in_features)
        self.ff = FeedForward(in_features, in_features, out_features, act="gelu", tensor_parallel=False)
        self.norm2 = LayerNorm(out_features)
        self.pos_embed = None
        if pos_embed_seq_len is not None:
            self.pos_embed = census.filled((1, pos_embed_seq_len, in_features), "pos_embed", 0.0)

    def construct(self, x):
        if self.pos_embed is not None:  # first-last-frame: the two images' tokens side by side
            x = x.reshape(-1, 2 * x.shape[1], x.shape[2])
            x = x + tiled_to(compute_weight(self.pos_embed), x.shape)
        return self.norm2(self.ff(self.norm1(x)))


class WanTimeTextImageEmbedding(nn.Cell):
    def __init__(self, config: WanTransformerConfig):
        super().__init__()
        dim = config.inner_dim
        self.freq_dim = config.freq_dim
        self.time_embedder = TwoLayerMLP(config.freq_dim, dim, "silu")
        self.time_proj = Linear(dim, 6 * dim)
        self.text_embedder = TwoLayerMLP(config.text_dim, dim, "gelu_pytorch_tanh")
        self.image_embedder = None
        if config.image_dim is not None:
            self.image_embedder = WanImageEmbedding(config.image_dim, dim, config.pos_embed_seq_len)

    def construct(self, timestep: np.ndarray, text, image=None):
        """(temb (N, D), timestep_proj (N, 6, D), text (B, T, D), image tokens (B, I, D) or None) of
        N timesteps (one per sample, or the distinct per-token ones)."""
        temb = self.time_embedder(Tensor(timestep_sinusoid(timestep, self.freq_dim)))
        timestep_proj = self.time_proj(ops.silu(temb))
        timestep_proj = timestep_proj.reshape(temb.shape[0], 6, temb.shape[1])
        image = None if image is None or self.image_embedder is None else self.image_embedder(image)
        return temb, timestep_proj, self.text_embedder(text), image
