"""Tiny Qwen2.5-Omni thinker configs, weights and inputs shared by the parity and parallel tests.

The reference is transformers' Qwen2_5OmniThinkerForConditionalGeneration on torch CPU (eager
attention, float32), with weights drawn wider than transformers' init (see qwen_vl_reference),
saved with the reference's own save_pretrained and loaded into ours with from_pretrained.

Token layouts follow transformers' Qwen2_5OmniProcessor: an audio is <audio_bos> n x <audio>
<audio_eos>; a video with its own audio is <vision_bos><audio_bos> then video and audio chunks of
seconds_per_chunk seconds interleaved (cut by the processor's own get_chunked_index), then
<audio_eos><vision_eos>. The tiny config counts position_id_per_seconds = 4 and 2 s chunks, so a
3-step video (1 s per grid) and a 9-token audio are both cut in two.
"""

from __future__ import annotations

import numpy as np
from helpers.qwen_vl_reference import PATCH_DIM, merged

AUDIO, AUDIO_START, AUDIO_END = 246, 247, 248
IMAGE, VIDEO, START, END = 250, 251, 252, 253
MEL = 8


def tiny_config(**text):
    from transformers import Qwen2_5OmniThinkerConfig

    text_config = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=256, rms_norm_eps=1e-6, eos_token_id=2,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]})
    text_config.update(text)
    config = Qwen2_5OmniThinkerConfig(
        text_config=text_config,
        vision_config=dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                           window_size=56, fullatt_block_indexes=[1]),
        audio_config=dict(num_mel_bins=MEL, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
                          d_model=32, n_window=4, output_dim=64, max_source_positions=64),
        audio_token_index=AUDIO, image_token_index=IMAGE, video_token_index=VIDEO, audio_start_token_id=AUDIO_START,
        audio_end_token_id=AUDIO_END, vision_start_token_id=START, vision_end_token_id=END,
        position_id_per_seconds=4, seconds_per_chunk=2)
    for part in (config, config.text_config, config.vision_config, config.audio_config):
        part._attn_implementation = "eager"
    return config


def write_reference(path, seed: int = 0, **text):
    """A random reference thinker saved to ``path``; returns it (torch, eval mode, float32)."""
    import torch
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration as Reference

    torch.manual_seed(seed)
    model = Reference(tiny_config(**text)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name or "ln_post" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                fan_in = int(np.prod(p.shape[1:])) if p.ndim > 1 else 1
                p.copy_(torch.randn_like(p) * (0.5 / fan_in ** 0.5 if p.ndim > 1 else 0.1))
    model.save_pretrained(str(path))
    return model


def audio_tokens(frames: int) -> int:
    """Audio placeholder tokens of ``frames`` mel frames (the processor's _get_feat_extract_output_lengths)."""
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import _get_feat_extract_output_lengths

    return int(_get_feat_extract_output_lengths(np.int64(frames)))


def interleaved(grid, frames: int, second_per_grid: float, config) -> list:
    """The processor's placeholder of a video with its own audio (module docstring)."""
    from transformers import Qwen2_5OmniProcessor

    per_chunk = int(config.position_id_per_seconds * config.seconds_per_chunk)
    t, h, w = grid
    video = np.repeat(np.arange(t), (h // 2) * (w // 2)) * second_per_grid * config.position_id_per_seconds
    audio = np.arange(audio_tokens(frames))
    video_chunks = Qwen2_5OmniProcessor.get_chunked_index(None, video, per_chunk)
    audio_chunks = Qwen2_5OmniProcessor.get_chunked_index(None, audio, per_chunk)
    ids = [START, AUDIO_START]
    for j in range(max(len(video_chunks), len(audio_chunks))):
        if j < len(video_chunks):
            ids += [VIDEO] * (video_chunks[j][1] - video_chunks[j][0])
        if j < len(audio_chunks):
            ids += [AUDIO] * (audio_chunks[j][1] - audio_chunks[j][0])
    return ids + [AUDIO_END, END]


def audio_placeholder(frames: int) -> list:
    return [AUDIO_START] + [AUDIO] * audio_tokens(frames) + [AUDIO_END]


def _vision_placeholder(token: int, grid) -> list:
    return [START] + [token] * merged(grid) + [END]


def features(frame_counts, rng) -> dict:
    """input_features (audios, MEL, longest) zero-padded, with their feature_attention_mask."""
    longest = max(frame_counts)
    values = np.zeros((len(frame_counts), MEL, longest), np.float32)
    mask = np.zeros((len(frame_counts), longest), np.int64)
    for i, n in enumerate(frame_counts):
        values[i, :, :n] = rng.standard_normal((MEL, n))
        mask[i, :n] = 1
    return {"input_features": values, "feature_attention_mask": mask}


CASES = ["text", "audio", "image", "video", "audio_in_video", "image_audio_video"]


def sample(kind: str, rng: np.random.Generator, config=None) -> dict:
    """The inputs of one named case (one sample, attention_mask all ones, labels on the text)."""
    config = config or tiny_config()
    text = lambda n: rng.integers(3, 240, n).tolist()  # noqa: E731
    ids, inputs, audios, images, videos, seconds = text(3), {}, [], [], [], []
    if kind == "text":
        ids += text(9)
    if kind in ("audio", "image_audio_video"):
        audios.append(37)
        ids += audio_placeholder(37) + text(2)
    if kind in ("image", "image_audio_video"):
        images.append((1, 8, 12))
        ids += _vision_placeholder(IMAGE, images[-1]) + text(4)
    if kind in ("video", "image_audio_video"):
        videos.append((3, 4, 6))
        seconds.append(1.5)
        ids += _vision_placeholder(VIDEO, videos[-1]) + text(5)
    if kind == "audio_in_video":
        videos.append((3, 4, 6))
        seconds.append(1.0)
        audios.append(37)
        ids += interleaved(videos[-1], 37, 1.0, config) + text(5)
        inputs["use_audio_in_video"] = True
    inputs["input_ids"] = np.array([ids], np.int64)
    inputs["attention_mask"] = np.ones_like(inputs["input_ids"])
    if audios:
        inputs.update(features(audios, rng))
    if images:
        inputs["pixel_values"] = rng.standard_normal((sum(np.prod(g) for g in images), PATCH_DIM)).astype(np.float32)
        inputs["image_grid_thw"] = np.array(images, np.int64)
    if videos:
        patches = sum(np.prod(g) for g in videos)
        inputs["pixel_values_videos"] = rng.standard_normal((patches, PATCH_DIM)).astype(np.float32)
        inputs["video_grid_thw"] = np.array(videos, np.int64)
        inputs["video_second_per_grid"] = np.array(seconds, np.float32)
    return with_labels(inputs)


def padded_pair(rng: np.random.Generator, frames=(37, 22), image: bool = True) -> dict:
    """Two samples with audios of different lengths (and, with ``image``, an image each), right-padded
    to one length; attention_mask marks the pads."""
    grids = [(1, 4, 4), (1, 8, 4)]
    rows = []
    for i, n in enumerate(frames):
        row = rng.integers(3, 240, 2).tolist() + audio_placeholder(n)
        if image:
            row += _vision_placeholder(IMAGE, grids[i])
        rows.append(row + rng.integers(3, 240, 3 + 2 * i).tolist())
    length = max(map(len, rows))
    ids, mask = np.zeros((2, length), np.int64), np.zeros((2, length), np.int64)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
    inputs = {"input_ids": ids, "attention_mask": mask, **features(list(frames), rng)}
    if image:
        inputs["pixel_values"] = rng.standard_normal((sum(np.prod(g) for g in grids), PATCH_DIM)).astype(np.float32)
        inputs["image_grid_thw"] = np.array(grids, np.int64)
    return with_labels(inputs)


def with_labels(inputs: dict) -> dict:
    """Labels: the text tokens (placeholders, markers of media and padding not counted)."""
    ids = inputs["input_ids"]
    labels = ids.copy()
    labels[np.isin(ids, [AUDIO, AUDIO_START, AUDIO_END, IMAGE, VIDEO, START, END])] = -100
    labels[inputs["attention_mask"] == 0] = -100
    inputs["labels"] = labels
    return inputs
