"""TMRoPE: Qwen2.5-Omni's 3-D positions, computed on the host in numpy, as transformers 5.24's
``Qwen2_5OmniPreTrainedModelForConditionalGeneration.get_rope_index`` number for number.

Walking a sample's (unpadded) tokens, each part starts at the previous part's largest position + 1:

* text, and every start / end marker: one position per token on all three axes;
* an image (grid t x h x w, merged h' x w'): temporal t_k * position_id_per_seconds (images have
  t = 1: temporal 0), height and width the merged grid coordinates, all offset by the start;
* a video: temporal int(k * second_per_grid * position_id_per_seconds), so one second of video
  is position_id_per_seconds temporal positions;
* an audio: one position per audio token (25 tokens a second: one per 40 ms);
* a video with its own audio (``use_audio_in_video``, laid out by the processor as
  <vision_bos><audio_bos> [video chunk 0][audio chunk 0][video chunk 1]... <audio_eos><vision_eos>):
  video and audio positions both start after the two markers and are cut into chunks of
  seconds_per_chunk seconds (position_id_per_seconds x seconds_per_chunk positions); the chunks
  are interleaved, video first, in the processor's token order.

Padding (attention_mask 0) gets position 1, as transformers writes; the deltas are the largest
position + 1 - the number of real tokens, per sample. Without images or videos transformers uses
the mask's running count (`text_positions`), audio included.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np

from mm_models_vl.qwen2_5_omni.audio import output_lengths


def text_positions(attention_mask: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(3, batch, seq) positions cumsum(mask) - 1 (padding 1) and their deltas, for inputs
    without images or videos."""
    mask = np.asarray(attention_mask).astype(np.int64)
    positions = np.where(mask == 0, 1, np.cumsum(mask, -1) - 1)
    deltas = positions.max(-1, keepdims=True) + 1 - mask.sum(-1, keepdims=True)
    return np.ascontiguousarray(np.broadcast_to(positions, (3,) + positions.shape)), deltas


def vision_grid(start: int, t_index: np.ndarray, grid_h: int, grid_w: int) -> np.ndarray:
    """(3, t x h x w) positions of a merged vision grid whose temporal positions are ``t_index``."""
    t, h, w = np.meshgrid(t_index, np.arange(grid_h), np.arange(grid_w), indexing="ij")
    return np.stack([t.reshape(-1), h.reshape(-1), w.reshape(-1)]) + start


def chunk_bounds(values: np.ndarray, per_chunk: int, offset: int) -> List[Tuple[int, int]]:
    """transformers' get_chunked_index: (start, end) slices of a rising sequence cut where a value
    - offset reaches the next multiple of ``per_chunk`` (one cut per element at most, as there)."""
    bounds, start, chunk = [], 0, 1
    for i, value in enumerate(values.tolist()):
        if value - offset >= chunk * per_chunk:
            bounds.append((start, i))
            start, chunk = i, chunk + 1
    bounds.append((start, len(values)))
    return bounds


class _Walk:
    """The positions of one sample's parts, in order; each part starts after the last one's maximum."""

    def __init__(self):
        self.parts: List[np.ndarray] = []

    def next_start(self) -> int:
        return int(self.parts[-1].max()) + 1 if self.parts else 0

    def run(self, length: int) -> None:
        if length:
            self.parts.append(np.broadcast_to(np.arange(length) + self.next_start(), (3, length)))

    def markers(self, count: int) -> None:
        """``count`` marker tokens at one position (a video with its audio has two on each side)."""
        self.run(1)
        self.parts += [self.parts[-1]] * (count - 1)

    def positions(self) -> np.ndarray:
        return np.concatenate(self.parts, 1) if self.parts else np.zeros((3, 0), np.int64)


def rope_index(input_ids: np.ndarray, attention_mask: np.ndarray, image_grid_thw=None, video_grid_thw=None,
               audio_feature_lengths=None, second_per_grids=None, use_audio_in_video: bool = False, *,
               config) -> Tuple[np.ndarray, np.ndarray]:
    """(3, batch, seq) TMRoPE positions and (batch, 1) deltas; see the module docstring. ``config``
    is the thinker's (token ids, position_id_per_seconds, seconds_per_chunk, spatial merge)."""
    if image_grid_thw is None and video_grid_thw is None:
        return text_positions(attention_mask)
    ids = {name: _token(config, name) for name in ("image_token_id", "video_token_id", "audio_token_id",
                                                    "vision_start_token_id", "audio_start_token_id")}
    media = _Media(config, image_grid_thw, video_grid_thw, audio_feature_lengths, second_per_grids)
    batch, seq = input_ids.shape
    out = np.ones((3, batch, seq), np.int64)
    deltas = []
    for b in range(batch):
        keep = np.asarray(attention_mask[b]).astype(bool)
        tokens = input_ids[b][keep]
        walk = _sample_walk(tokens, ids, media, use_audio_in_video, b)
        row = walk.positions()
        out[:, b, keep] = row
        deltas.append((int(row.max()) + 1 if row.size else 0) - len(tokens))  # a sample of padding alone: 0
    return out, np.asarray(deltas, np.int64)[:, None]


def _token(config, name: str) -> int:
    value = getattr(config, name, None)
    if value is None:
        raise ValueError(f"the thinker config has no {name}: set it (Qwen2.5-Omni's config.json gives "
                         "vision_start_token_id 151652); the 3-D positions are found by it, as in transformers")
    return int(value)


class _Media:
    """The grids, audio token counts and seconds per grid, consumed in order across the batch."""

    def __init__(self, config, image_grid_thw, video_grid_thw, audio_feature_lengths, second_per_grids):
        self.merge = config.vision_config.spatial_merge_size
        self.per_second = config.position_id_per_seconds
        self.per_chunk = int(config.position_id_per_seconds * config.seconds_per_chunk)
        self.images = iter(np.asarray(image_grid_thw, np.int64).reshape(-1, 3) if image_grid_thw is not None else ())
        self.videos = iter(np.asarray(video_grid_thw, np.int64).reshape(-1, 3) if video_grid_thw is not None else ())
        self.audios = iter(output_lengths(audio_feature_lengths).reshape(-1).tolist()
                           if audio_feature_lengths is not None else ())
        self.seconds = iter(np.asarray(second_per_grids, np.float32).reshape(-1)
                            if second_per_grids is not None else ())

    def take(self, kind: str, sample: int):
        try:
            return next(getattr(self, kind))
        except StopIteration:
            what, source = {"images": ("image grids", "image_grid_thw"), "videos": ("video grids", "video_grid_thw"),
                            "audios": ("audios", "feature_attention_mask's rows"),
                            "seconds": ("seconds per video grid", "video_second_per_grid")}[kind]
            raise ValueError(f"sample {sample}'s placeholders need more {what} than {source} gives") from None

    def vision(self, start: int, grid, seconds: float) -> np.ndarray:
        t, h, w = (int(v) for v in grid)
        t_index = (np.arange(t, dtype=np.float32) * np.float32(seconds) * np.float32(self.per_second)).astype(np.int64)
        return vision_grid(start, t_index, h // self.merge, w // self.merge)


def _sample_walk(tokens: np.ndarray, ids: dict, media: _Media, use_audio_in_video: bool, b: int) -> _Walk:
    """transformers' loop over one sample: the next image / video / audio placeholder from ``st``
    decides the part; text before it is a run of positions."""
    listed = tokens.tolist()
    starts = np.nonzero(tokens == ids["vision_start_token_id"])[0]
    after_start = tokens[np.minimum(starts + 1, len(tokens) - 1)] if len(starts) else np.zeros(0, np.int64)
    remaining = {"image": int((after_start == ids["image_token_id"]).sum()),
                 "audio": int((tokens == ids["audio_start_token_id"]).sum())}
    remaining["video"] = int((after_start == (ids["audio_start_token_id"] if use_audio_in_video
                                              else ids["video_token_id"])).sum())
    walk, st = _Walk(), 0
    total = remaining["image"] + remaining["audio"] + (0 if use_audio_in_video else remaining["video"])
    for _ in range(total):
        found = {kind: _find(listed, ids[f"{kind}_token_id"], st) if remaining[kind] > 0 else len(listed) + 1
                 for kind in ("image", "video", "audio")}
        kind = min(("audio", "image", "video"), key=lambda k: found[k])  # transformers tests audio first on ties
        markers = 2 if kind == "video" and use_audio_in_video else 1  # <vision_bos><audio_bos>
        text = found[kind] - st - markers
        if text < 0:
            raise ValueError(f"sample {b}: a {kind} placeholder at {found[kind]} lacks its start marker token(s)")
        walk.run(text)
        walk.markers(markers)
        if kind == "audio":
            length = media.take("audios", b)
            walk.run(length)
        elif kind == "image":
            grid = media.take("images", b)
            walk.parts.append(media.vision(walk.next_start(), grid, 1.0))
            length = int(np.prod(grid)) // media.merge ** 2
        elif not use_audio_in_video:
            grid = media.take("videos", b)
            walk.parts.append(media.vision(walk.next_start(), grid, media.take("seconds", b)))
            length = int(np.prod(grid)) // media.merge ** 2
        else:
            length = _video_with_audio(walk, media, b)
        walk.markers(markers)
        st += text + 2 * markers + length
        remaining[kind] -= 1
        if kind == "video" and use_audio_in_video:
            remaining["audio"] -= 1
    if st < len(listed):
        walk.run(len(listed) - st)
    return walk


def _find(tokens: list, token: int, start: int) -> int:
    try:
        return tokens.index(token, start)
    except ValueError:
        return len(tokens) + 1


def _video_with_audio(walk: _Walk, media: _Media, b: int) -> int:
    """A video and its audio interleaved in chunks (module docstring); returns their token count."""
    start = walk.next_start()
    audio_len = media.take("audios", b)
    grid = media.take("videos", b)
    audio = np.broadcast_to(np.arange(audio_len) + start, (3, audio_len))
    video = media.vision(start, grid, media.take("seconds", b))
    video_chunks = chunk_bounds(video[0], media.per_chunk, start)
    audio_chunks = chunk_bounds(audio[0], media.per_chunk, start)
    for j in range(max(len(video_chunks), len(audio_chunks))):
        if j < len(video_chunks):
            walk.parts.append(video[:, slice(*video_chunks[j])])
        if j < len(audio_chunks):
            walk.parts.append(audio[:, slice(*audio_chunks[j])])
    return audio_len + video.shape[1]
