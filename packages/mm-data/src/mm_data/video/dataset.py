"""Video-text samples for diffusion training: a clip in [-1, 1] and its tokenised caption.

`VideoTextDataset.get(index, epoch)` decodes only the clip's frames (`decode.read_frames`),
resized by swscale to cover the sample's aspect bucket and cropped to it, scaled to [-1, 1] as
(C, T, H, W) float32. Every random choice of a sample (clip start, crop, which caption, caption
dropout) comes from a generator seeded by (seed, epoch, index), so a sample is the same whichever
worker makes it and whenever — which is what makes resuming and changing the worker count exact.
Each sample's bucket (frames, height, width) is known before decoding, from the annotation's
metadata or a header probe, so a sampler can batch equal shapes together.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from mm_data.errors import BadInputLog, BadSample
from mm_data.shards import ShardSet
from mm_data.video.annotations import VideoRecord, load_records
from mm_data.video.decode import VideoInfo, probe, read_frames
from mm_data.video.pairs import pair_records, read_clip_pairs
from mm_data.video.shards import clip_source, shard_records
from mm_data.video.spatial import AspectBuckets, cover_size, crop_box
from mm_data.video.temporal import FrameBuckets, clip_indices, frame_step, frames_available


class VideoTextDataset:
    """See the module docstring. ``tokenizer``: a transformers tokenizer (T5 / UMT5) or None."""

    def __init__(self, records: Sequence[VideoRecord], frames: FrameBuckets = FrameBuckets(),
                 buckets: AspectBuckets = AspectBuckets(), fps: Optional[float] = 16.0, speed: float = 1.0,
                 tokenizer=None, max_text_length: int = 512, random_crop: bool = True,
                 caption_dropout: float = 0.0, seed: int = 0, bad_input: Optional[BadInputLog] = None,
                 shards: Optional[ShardSet] = None):
        self.frames, self.buckets, self.fps, self.speed, self.shards = frames, buckets, fps, speed, shards
        self.tokenizer, self.max_text_length = tokenizer, max_text_length
        self.random_crop, self.caption_dropout, self.seed = random_crop, caption_dropout, seed
        self.bad_input = bad_input if bad_input is not None else BadInputLog()
        if self.bad_input.total is None:
            self.bad_input.total = len(records)
        self.records: List[VideoRecord] = []
        self.infos: List[VideoInfo] = []
        self.keys: List[Tuple[int, int, int]] = []
        for record in records:  # buckets known up front; videos that cannot be used are skipped here
            try:
                info = self._info(record)
                key = self._key(info)
            except BadSample as bad:
                self.bad_input.skip(bad)
                continue
            self.records.append(record)
            self.infos.append(info)
            self.keys.append(key)
        self.bad_input.check()

    @classmethod
    def from_annotations(cls, path: str, max_bad_fraction: float = 0.05, folder: Optional[str] = None,
                         pairs: bool = False, data_format: str = "json", **kwargs):
        """Read any supported annotation layout (see `annotations.load_records`) into a data set;
        with ``pairs`` a file of clip pairs (mm_data.video.pairs: both clips of each pair, in
        order, captioned with its prompt; the pairs in ``clip_pairs``); with ``data_format``
        parquet | webdataset | arrow the rows of shards (`mm_data.video.shards`)."""
        log = BadInputLog(max_bad_fraction)
        if data_format != "json":
            if pairs:
                raise ValueError("clip pairs are read from JSON / JSONL files; sharded clip pairs are not read: "
                                 "use data.format json for preference data")
            shards = ShardSet.open(path, data_format)
            return cls(shard_records(shards, log), bad_input=log, shards=shards, **kwargs)
        if not pairs:
            return cls(load_records(path, log, folder), bad_input=log, **kwargs)
        clip_pairs = read_clip_pairs(path, log, folder)
        dataset = cls(pair_records(clip_pairs), bad_input=log, **kwargs)
        dataset.clip_pairs = clip_pairs
        return dataset

    def __len__(self) -> int:
        return len(self.records)

    def source(self, index: int) -> str:
        return self.records[index].path

    def _info(self, record: VideoRecord) -> VideoInfo:
        if record.has_metadata:
            return VideoInfo(record.path, record.num_frames, record.fps, record.height, record.width)
        if record.row is None:
            return probe(record.path)
        with _named(record):
            return replace(probe(self.clip(record)), path=record.path)

    def clip(self, record: VideoRecord):
        """The record's video: its path, or a shard row's clip (bytes or a path)."""
        return record.path if record.row is None else clip_source(self.shards, record.row)

    @property
    def block_sizes(self) -> Optional[List[int]]:
        """The usable samples of each shard block, in order (the sampler's block order), or None."""
        if self.shards is None:
            return None
        blocks = [self.shards.block_of(record.row) for record in self.records]
        return np.bincount(np.asarray(blocks, np.int64), minlength=len(self.shards.block_sizes)).tolist()

    def _key(self, info: VideoInfo) -> Tuple[int, int, int]:
        step = frame_step(info.fps, self.fps, self.speed)
        length = self.frames.length(frames_available(info.num_frames, step), info.path)
        return (length,) + self.buckets.bucket(info.height, info.width, info.path)

    def get(self, index: int, epoch: int = 0) -> Dict[str, np.ndarray]:
        """Sample ``index`` as drawn in ``epoch``; raises `BadSample` if its video cannot be decoded."""
        record, info, (length, height, width) = self.records[index], self.infos[index], self.keys[index]
        rng = np.random.default_rng([self.seed, epoch, index])
        indices = clip_indices(info.num_frames, length, frame_step(info.fps, self.fps, self.speed),
                               rng if self.random_crop else None)
        resized = cover_size(info.height, info.width, (height, width))
        with _named(record):
            clip = read_frames(self.clip(record), indices, size=resized)
        top, left = crop_box(resized, (height, width), rng if self.random_crop else None)
        clip = clip[:, top:top + height, left:left + width]
        video = np.ascontiguousarray(clip.transpose(3, 0, 1, 2), np.float32) / np.float32(127.5) - np.float32(1.0)
        caption = record.captions[int(rng.integers(len(record.captions)))]
        if self.caption_dropout and rng.random() < self.caption_dropout:
            caption = ""  # the unconditional sample classifier-free guidance learns from
        sample = {"video": video, "caption": caption, "index": np.int64(index)}
        if self.tokenizer is not None:
            tokens = self.tokenizer(caption, padding="max_length", truncation=True, max_length=self.max_text_length,
                                    return_tensors="np")
            sample["input_ids"] = tokens["input_ids"][0].astype(np.int64)
            sample["attention_mask"] = tokens["attention_mask"][0].astype(np.int64)
        return sample

    def __getitem__(self, index: int) -> Dict[str, np.ndarray]:
        return self.get(index)


@contextmanager
def _named(record: VideoRecord):
    """A shard row's bad clip named by its row (shard[row]), not by its bytes."""
    try:
        yield
    except BadSample as bad:
        if record.row is None or bad.source == record.path:
            raise
        raise BadSample(record.path, bad.reason) from None
