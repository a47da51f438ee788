"""Forward FLOPs of the Qwen2.5-Omni thinker (for MFU), from the config and the inputs' shapes alone.

Matrix products only (mm_profiling.flops' convention). The language model and the vision tower
count as Qwen2.5-VL's (the tower's q / k / v apart cost what the fused qkv does). The audio
encoder, over all audios of a batch at once:

  conv stem   the chunks (2 n_window frames, the batch padded to its longest chunk) through
              conv1 (kernel 3, mel -> d) and conv2 (kernel 3, stride 2, d -> d)
  layers      q / k / v / out and the two FFN matrices on the valid positions, attention within
              each chunk's positions
  proj        d -> output_dim on the pooled positions
"""

from __future__ import annotations

import numpy as np

from mm_models_vl.qwen2_5_omni.audio import audio_layout, output_lengths
from mm_models_vl.qwen2_5_vl.flops import per_sample_flops, qwen2_5_vl_flops, sample_lengths, vision_flops
from mm_profiling.flops import matmul


def audio_flops(config, feature_lens) -> int:
    """The audio encoder over audios of ``feature_lens`` feature frames (one forward, batched)."""
    audio = config.audio_config
    lens = np.asarray(feature_lens, np.int64).reshape(-1)
    if not lens.size:
        return 0
    plan = audio_layout(lens, audio.n_window)
    chunks, longest = plan["frame_index"].shape
    d, heads = audio.d_model, audio.encoder_attention_heads
    total = matmul(chunks * longest, 3 * audio.num_mel_bins, d) + matmul(chunks * ((longest - 1) // 2 + 1), 3 * d, d)
    valid = plan["valid"].size
    segments = np.bincount(plan["segments"][0])
    attention = sum(2 * heads * matmul(n, d // heads, n) for n in segments.tolist())
    total += audio.encoder_layers * (4 * matmul(valid, d, d) + 2 * matmul(valid, d, audio.encoder_ffn_dim) + attention)
    return total + matmul(int(output_lengths(lens).sum()), d, audio.output_dim)


def batch_flops(config, batch: dict) -> float:
    """Forward FLOPs per sample of a micro-batch of forward keywords."""
    per_sample = per_sample_flops(batch, lambda seq: qwen2_5_vl_flops(config, seq),
                                  lambda grids: vision_flops(config, grids))
    mask = batch.get("feature_attention_mask")
    audio = 0 if mask is None else audio_flops(config, np.asarray(mask).sum(-1))
    return per_sample + audio / len(sample_lengths(batch))
