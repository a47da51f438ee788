"""Qwen2.5-Omni audio encoder: the twin of transformers' Qwen2_5OmniAudioEncoder (Whisper's encoder
run in windows). Parameter names are transformers' (``model.audio_tower.*``).

Input: the log-mel features of each audio, (num_mel_bins, frames_i), concatenated over the audios.

1. Each audio is cut into chunks of 2 n_window frames (the last one shorter); every chunk runs
   through the conv stem on its own, zero-padded at both ends:
       conv1 (kernel 3, pad 1) -> gelu -> padded frames zeroed -> conv2 (kernel 3, stride 2, pad 1) -> gelu
   so a chunk of L frames gives (L - 1) // 2 + 1 positions. The convolutions are matmuls over
   the three shifted copies of the input (im2col), which on CPU is one GEMM per conv.
2. Sinusoidal positions restart in every chunk: row p of the table is added to position p of
   each chunk.
3. The valid positions of all chunks form one packed sequence; each pre-LN encoder layer
   attends within its chunk only (block-diagonal attention by segment ids).
4. Per audio, consecutive positions are averaged in pairs (AvgPool1d(2, 2); an odd last one is
   dropped), then ln_post and the projection to the language model's width:
       tokens_i = ((frames_i - 1) // 2 + 1 - 2) // 2 + 1
   (`output_lengths`, the number of audio placeholder tokens the processor writes).

The tower runs whole on every rank, as the vision tower does. ``audio_bos_eos_token`` is in the
checkpoint but no forward uses it; it is kept (so saved folders hold every key) and frozen (torch
gives it no gradient, so its optimizer would never touch it either).
"""

from __future__ import annotations

from typing import Dict

import numpy as np
from mindspore import Tensor, nn, ops

from mm_parallel import ops as kernels
from mm_parallel.blocks import LayerNorm, Linear, activation
from mm_parallel.ops.device import tiled_to
from mm_parallel.tensor_parallel import linear, new_parameter


def output_lengths(frames) -> np.ndarray:
    """Audio tokens of audios of ``frames`` mel frames: after the stride-2 conv, then the pooling."""
    after_conv = (np.asarray(frames, np.int64) - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> np.ndarray:
    """(length, channels) [sin | cos] table of Whisper's positions, in float32 as torch computes it."""
    if channels % 2:
        raise ValueError(f"sinusoidal positions need an even width, got d_model={channels}")
    increment = np.float32(np.log(max_timescale) / (channels // 2 - 1))
    inv_timescales = np.exp(-increment * np.arange(channels // 2, dtype=np.float32))
    scaled = np.arange(length, dtype=np.float32)[:, None] * inv_timescales[None, :]
    return np.concatenate([np.sin(scaled), np.cos(scaled)], 1).astype(np.float32)


def audio_layout(feature_lens, n_window: int) -> Dict[str, np.ndarray]:
    """Host plan of one forward (transformers' chunk_and_pad_features, get_valid_indices,
    get_audio_cu_seqlens, get_pool_indices) for audios of ``feature_lens`` frames:

      frame_index  (chunks, longest) row of each chunk frame in the concatenated features, or
                   the index of an appended zero row where the chunk is padded
      frame_mask   (chunks, longest, 1) 1 on real frames (conv1's output is zeroed elsewhere)
      valid        flat positions (chunk * after_conv + p) of the real conv2 outputs
      segments     (1, valid) chunk number of each of them (attention stays within a chunk)
      pool         first position of each averaged pair, in the packed sequence
    """
    lens = np.asarray(feature_lens, np.int64).reshape(-1)
    if lens.size == 0 or np.any(lens <= 0):
        raise ValueError(f"every audio needs at least one feature frame, got lengths {lens.tolist()}")
    window = 2 * n_window
    chunks = []
    for length in lens.tolist():
        full, tail = divmod(length, window)
        chunks += [window] * full + ([tail] if tail else [])
    chunks = np.asarray(chunks, np.int64)
    longest, total = int(chunks.max()), int(lens.sum())
    starts = np.concatenate([[0], np.cumsum(chunks)[:-1]])
    offsets = np.arange(longest)[None, :]
    real = offsets < chunks[:, None]
    frame_index = np.where(real, starts[:, None] + offsets, total)
    after_conv = (chunks - 1) // 2 + 1
    conv_len = (longest - 1) // 2 + 1
    valid = (np.arange(conv_len)[None, :] < after_conv[:, None]).reshape(-1).nonzero()[0]
    segments = np.repeat(np.arange(len(chunks)), after_conv)
    per_audio = (lens - 1) // 2 + 1
    pooled = output_lengths(lens)
    audio_start = np.concatenate([[0], np.cumsum(per_audio)[:-1]])
    pool = np.concatenate([start + 2 * np.arange(n) for start, n in zip(audio_start, pooled)])
    return dict(frame_index=frame_index.astype(np.int32), frame_mask=real[..., None].astype(np.float32),
                valid=valid.astype(np.int32), segments=segments[None].astype(np.int32), pool=pool.astype(np.int32))


class Conv1d(nn.Cell):
    """torch.nn.Conv1d (weight (out, in, kernel), zero padding) on channel-last input (n, length, in):
    im2col over the kernel's shifted copies, one matmul; ``stride`` keeps every stride-th output."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, padding: int = 0):
        super().__init__()
        if (kernel_size - 1) % stride:
            raise ValueError(f"Conv1d here needs stride {stride} to divide kernel_size - 1 = {kernel_size - 1}")
        self.kernel, self.stride, self.padding = kernel_size, stride, padding
        self.weight = new_parameter((out_channels, in_channels, kernel_size), "weight", None, None)
        self.bias = new_parameter((out_channels,), "bias", None, None, zeros=True)

    def construct(self, x):
        s, k = self.stride, self.kernel
        length = (x.shape[1] + 2 * self.padding - k) // s + 1
        # output t reads padded frame s t + j = row t + j // s, phase j % s of the frames grouped
        # in s-tuples (plain slices: MindSpore 2.7's CPU backward of a strided slice fails)
        rows = length + (k - 1) // s
        x = ops.pad(x, (0, 0, self.padding, s * rows - x.shape[1] - self.padding))
        x = x.reshape(x.shape[0], rows, s, x.shape[2])
        taps = [x[:, j // s:j // s + length, j % s] for j in range(k)]
        windows = ops.concat(taps, -1)  # (n, length, kernel * in), kernel-major
        weight = self.weight.transpose(0, 2, 1).reshape(self.weight.shape[0], -1)
        return linear(windows, weight, self.bias)


class Qwen2_5OmniAudioAttention(nn.Cell):
    """Self-attention over the packed positions, within each chunk; k_proj has no bias (Whisper's)."""

    def __init__(self, config):
        super().__init__()
        dim = config.d_model
        self.num_heads = config.encoder_attention_heads
        if dim % self.num_heads:
            raise ValueError(f"d_model {dim} must be divisible by encoder_attention_heads {self.num_heads}")
        self.head_dim = dim // self.num_heads
        self.q_proj = Linear(dim, dim, bias=True)
        self.k_proj = Linear(dim, dim, bias=False)
        self.v_proj = Linear(dim, dim, bias=True)
        self.out_proj = Linear(dim, dim, bias=True)

    def construct(self, x, segments):
        n = x.shape[0]
        shape = (1, n, self.num_heads, self.head_dim)
        out = kernels.attention(self.q_proj(x).reshape(shape), self.k_proj(x).reshape(shape),
                                self.v_proj(x).reshape(shape), segment_ids=segments)
        return self.out_proj(out.reshape(n, -1))


class Qwen2_5OmniAudioEncoderLayer(nn.Cell):
    """Pre-LN Whisper encoder layer: x + attn(ln(x)), then x + fc2(act(fc1(ln(x))))."""

    def __init__(self, config):
        super().__init__()
        dim = config.d_model
        self.self_attn = Qwen2_5OmniAudioAttention(config)
        self.self_attn_layer_norm = LayerNorm(dim)
        self.fc1 = Linear(dim, config.encoder_ffn_dim)
        self.fc2 = Linear(config.encoder_ffn_dim, dim)
        self.final_layer_norm = LayerNorm(dim)
        self.act = activation(config.activation_function)

    def construct(self, x, segments):
        x = x + self.self_attn(self.self_attn_layer_norm(x), segments)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class _Table(nn.Cell):
    """torch's nn.Embedding kept only for its checkpoint tensor (``weight``), frozen."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.weight = new_parameter((rows, dim), "weight", None, None)
        self.weight.requires_grad = False


class Qwen2_5OmniAudioEncoder(nn.Cell):
    """(num_mel_bins, total frames) features and per-audio frame counts -> (total tokens, output_dim)."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        if config.scale_embedding:
            raise ValueError("scale_embedding=True is not supported (Qwen2.5-Omni's audio encoder does not use it)")
        dim = config.d_model
        self.n_window = config.n_window
        self.conv1 = Conv1d(config.num_mel_bins, dim, 3, padding=1)
        self.conv2 = Conv1d(dim, dim, 3, stride=2, padding=1)
        self.positions = sinusoids(config.max_source_positions, dim)
        self.audio_bos_eos_token = _Table(2, config.output_dim)
        self.layers = nn.CellList([Qwen2_5OmniAudioEncoderLayer(config) for _ in range(config.encoder_layers)])
        self.ln_post = LayerNorm(dim)
        self.proj = Linear(dim, config.output_dim)

    def construct(self, input_features, feature_lens):
        plan = audio_layout(feature_lens, self.n_window)
        mel, total = input_features.shape
        if total != int(np.sum(feature_lens)) or mel != self.config.num_mel_bins:
            raise ValueError(f"input_features {tuple(input_features.shape)} must be (num_mel_bins="
                             f"{self.config.num_mel_bins}, {int(np.sum(feature_lens))} frames of the audios)")
        rows = ops.concat([input_features.transpose(1, 0), ops.zeros((1, mel), input_features.dtype)], 0)
        chunks = ops.gather(rows, Tensor(plan["frame_index"]), 0)  # (chunks, longest, mel)
        x = kernels.gelu(self.conv1(chunks))
        x = x * tiled_to(Tensor(plan["frame_mask"]).astype(x.dtype), x.shape)
        x = kernels.gelu(self.conv2(x))
        count, length, dim = x.shape
        if length > self.positions.shape[0]:
            raise ValueError(f"a chunk of {length} positions exceeds max_source_positions "
                             f"{self.positions.shape[0]}: n_window is too large for this config")
        x = x + tiled_to(Tensor(self.positions[None, :length]).astype(x.dtype), x.shape)
        x = ops.gather(x.reshape(count * length, dim), Tensor(plan["valid"]), 0)
        segments = plan["segments"]  # host ids: attention reads them there (see qwen2_5_vl.vision._segments)
        for layer in self.layers:
            x = layer(x, segments)
        pool = plan["pool"]
        x = (ops.gather(x, Tensor(pool), 0) + ops.gather(x, Tensor(pool + 1), 0)) * 0.5
        return self.proj(self.ln_post(x))
