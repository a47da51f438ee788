"""Qwen2.5-Omni SFT samples: LLaMA-Factory conversations with images, videos and audios.

`OmniSFTDataset` is `VLSFTDataset` (same files, processors, bad-input handling) plus audio:
each ``<audio>`` of the text takes the next path of ``audios``, decoded to 16 kHz mono
(`mm_data.audio.load_audio`, at most the feature extractor's chunk_length seconds) and turned
into Whisper features; with ``use_audio_in_video`` every video brings its own audio track, and
the video's pads are interleaved with its audio's in ``seconds_per_chunk`` chunks as
transformers' Qwen2_5OmniProcessor interleaves them (`video_audio_runs`). The chat format is
Qwen2.5-Omni's (its token names, its default system turn).

A sample gives transformers' thinker keywords: ``input_ids``, ``attention_mask``, ``labels``,
``pixel_values`` / ``image_grid_thw``, ``pixel_values_videos`` / ``video_grid_thw`` /
``video_second_per_grid``, ``input_features`` (audios, mel bins, frames) and
``feature_attention_mask``; audios are in the order their pads appear in the text, which is the
order the model consumes them. ``use_audio_in_video`` itself is a setting of the run (the model
takes it per batch), not a field. A missing, unreadable or cut audio file, or a video without an
audio track under ``use_audio_in_video``, is a `BadSample`.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from mm_data.audio import WhisperFeatureExtractor, load_audio
from mm_data.errors import BadSample, logger
from mm_data.vl.conversation import Conversation
from mm_data.vl.dataset import MEDIA_FIELDS, VLSFTDataset, named_by_row
from mm_data.vl.pairs import pair_length
from mm_data.vl.template import OMNI_MEDIA

OMNI_SYSTEM = ("You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
               "auditory and visual inputs, as well as generating text and speech.")
OMNI_FIELDS = MEDIA_FIELDS + ("video_second_per_grid", "input_features", "feature_attention_mask")
_MEDIA_PLACEHOLDER = re.compile(r"<audio>|<video>")


def audio_tokens(frames) -> np.ndarray:
    """Audio pads of audios of ``frames`` feature frames (the thinker's encoder: a stride-2 conv, then
    pairs pooled)."""
    after_conv = (np.asarray(frames, np.int64) - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


def chunk_bounds(values: Sequence[float], per_chunk: int) -> List[Tuple[int, int]]:
    """(start, end) slices of ascending ``values`` cut where a value reaches the next multiple of
    ``per_chunk`` — one cut per crossing, as transformers' get_chunked_index cuts."""
    bounds, start, chunk = [], 0, 1
    for i, value in enumerate(values):
        if value >= chunk * per_chunk:
            bounds.append((start, i))
            start, chunk = i, chunk + 1
    return bounds + [(start, len(values))]


def video_audio_runs(grid_thw, merge_size: int, second_per_grid: float, audio_pads: int,
                     position_id_per_seconds: float = 25, seconds_per_chunk: float = 2.0) -> List[Tuple[str, int]]:
    """A video with its audio as ("video" | "audio", count) runs: the video's pads timed at
    t x second_per_grid x position_id_per_seconds per temporal patch t, the audio's at 0, 1, 2 ...;
    both cut into chunks of position_id_per_seconds x seconds_per_chunk, then alternated (video
    chunk j, audio chunk j) while either has chunks left."""
    t, h, w = (int(v) for v in grid_thw)
    per_frame = (h // merge_size) * (w // merge_size)
    video_times = np.repeat(np.arange(t) * float(second_per_grid) * position_id_per_seconds, per_frame)
    per_chunk = int(position_id_per_seconds * seconds_per_chunk)
    video = chunk_bounds(video_times, per_chunk)
    audio = chunk_bounds(np.arange(audio_pads), per_chunk)
    runs = []
    for j in range(max(len(video), len(audio))):
        runs += [("video", video[j][1] - video[j][0])] if j < len(video) else []
        runs += [("audio", audio[j][1] - audio[j][0])] if j < len(audio) else []
    return [(kind, n) for kind, n in runs if n]


class OmniSFTDataset(VLSFTDataset):
    """See the module docstring. Arguments as `VLSFTDataset`'s, plus the audio feature extractor
    (default: Qwen2.5-Omni's 128-bin Whisper features) and the interleaving settings."""

    media = OMNI_MEDIA  # the chat template's media tokens
    media_fields = OMNI_FIELDS  # audio features too: padded to the batch's longest audio, joined

    def __init__(self, conversations: Sequence[Conversation], tokenizer, image_processor=None, video_processor=None,
                 audio_processor: Optional[WhisperFeatureExtractor] = None, use_audio_in_video: bool = False,
                 position_id_per_seconds: float = 25, seconds_per_chunk: float = 2.0,
                 default_system: Optional[str] = OMNI_SYSTEM, **kwargs):
        super().__init__(conversations, tokenizer, image_processor, video_processor, default_system=default_system,
                         **kwargs)
        self.audio_processor = audio_processor or WhisperFeatureExtractor()
        self.use_audio_in_video = use_audio_in_video
        self.position_id_per_seconds, self.seconds_per_chunk = position_id_per_seconds, seconds_per_chunk
        self.cut_audio: Dict[str, float] = {}  # audios longer than the features' chunk_length: path -> seconds

    def _audio_cut(self, path: str, seconds: float) -> None:
        """Counted and logged once per file: only the first chunk_length seconds become features
        (as transformers' WhisperFeatureExtractor cuts them)."""
        if path not in self.cut_audio:
            self.cut_audio[path] = seconds
            logger.warning("audio %s is %.1f s long: only its first %d s are used (the Whisper features' "
                           "chunk_length); %d audio(s) cut so far", path, seconds, self.audio_processor.chunk_length,
                           len(self.cut_audio))

    def audio_sources(self, conversation: Conversation) -> List[Tuple[str, str]]:
        """("audio" | "video", path) of every audio in text order: each <audio> placeholder's file
        and, under use_audio_in_video, each <video>'s own track."""
        audios, videos, sources = iter(conversation.audios), iter(conversation.videos), []
        texts = [conversation.system or ""] + [text for _, text in conversation.turns]
        for placeholder in (found for text in texts for found in _MEDIA_PLACEHOLDER.findall(text)):
            if placeholder == "<audio>":
                sources.append(("audio", next(audios)))
            else:
                path = next(videos)
                if self.use_audio_in_video:
                    sources.append(("video", path))
        return sources

    @named_by_row
    def get(self, index: int, epoch: int = 0) -> Dict[str, np.ndarray]:
        conversation = self.conversations[index]
        sample, image_tokens, video_tokens, _, seconds = self.vision(conversation)
        if conversation.videos:
            sample["video_second_per_grid"] = seconds
        sources = self.audio_sources(conversation)
        pads: List[int] = []
        if sources:
            features = self.audio_processor(self._waves(sources))
            sample["input_features"] = features["input_features"]
            sample["feature_attention_mask"] = features["attention_mask"]
            pads = audio_tokens(features["attention_mask"].sum(-1)).tolist()
        sample.update(self.tokens(conversation, lambda c, limit: self._encode(
            c, image_tokens, video_tokens, sample.get("video_grid_thw", ()), sample.get("video_second_per_grid", ()),
            sources, pads, limit)))
        sample["attention_mask"] = np.ones_like(sample["input_ids"])
        return self.indexed(sample, index)

    @named_by_row
    def length(self, index: int) -> int:
        """Tokens of sample ``index``: images and videos from headers and probes (no pixels
        decoded); audios decoded alone (their pads follow the resampler's exact sample count),
        no features computed."""
        conversation = self.conversations[index]
        image_tokens, video_tokens, _, grids, seconds = self.vision_from_headers(conversation)
        sources = self.audio_sources(conversation)
        frames = [self.audio_processor.frames(size) for size in self._wave_sizes(conversation, sources)]
        pads = audio_tokens(frames).tolist() if frames else []
        return pair_length(self.tokens(conversation, lambda c, limit: self._encode(
            c, image_tokens, video_tokens, grids, seconds, sources, pads, limit)))

    def _wave_sizes(self, conversation: Conversation, sources: List[Tuple[str, str]]) -> List[int]:
        """Each audio's samples as `_waves` gives them: from a shard's media_info ("audios" and, for
        videos' tracks, "video_audios": samples at 16 kHz, written by `mm-data convert`) or decoded."""
        info = conversation.media_info or {}
        rate, limit = self.audio_processor.sampling_rate, self.audio_processor.chunk_length
        if rate != 16000 or "audios" not in info or (self.use_audio_in_video and "video_audios" not in info):
            return [wave.size for wave in self._waves(sources)]
        audios, tracks, sizes = iter(info["audios"]), iter(info.get("video_audios", [])), []
        for kind, path in sources:
            size = next(audios) if kind == "audio" else next(tracks)
            if size is None:
                raise BadSample(conversation.source, "a video without an audio track under use_audio_in_video")
            sizes.append(min(int(size), limit * rate))
        return sizes

    def _waves(self, sources: List[Tuple[str, str]]) -> List[np.ndarray]:
        limit = self.audio_processor.chunk_length
        return [load_audio(path, self.audio_processor.sampling_rate, max_seconds=limit, on_cut=self._audio_cut)
                for _, path in sources]

    def _encode(self, conversation: Conversation, image_tokens, video_tokens, grids, seconds, sources,
                pads: List[int], max_length: Optional[int]) -> Dict[str, np.ndarray]:
        """The template's tokens, each video with its audio's pads interleaved under
        use_audio_in_video (``grids`` / ``seconds``: each video's grid and seconds per temporal patch)."""
        in_video = iter(n for (kind, _), n in zip(sources, pads) if kind == "video")
        runs = [video_audio_runs(grid, self.video_processor.merge_size, per_grid, next(in_video),
                                 self.position_id_per_seconds, self.seconds_per_chunk)
                for grid, per_grid in zip(grids, seconds)] if self.use_audio_in_video else []
        standalone = [n for (kind, _), n in zip(sources, pads) if kind == "audio"]
        tokens = self.template.encode(conversation, image_tokens, video_tokens, standalone, max_length=max_length,
                                      video_runs=runs)
        tokens.pop("mm_token_type_ids")  # TMRoPE finds the media by their token ids
        return tokens
