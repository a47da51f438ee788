"""Vision-language SFT samples: a conversation with its images and videos, as model inputs.

`VLSFTDataset.get(index)` loads the sample's images (PIL) and videos (PyAV: only the frames
`Qwen2VLVideoProcessor.sample_frames` keeps, at ``video_fps`` within [min_frames, max_frames]),
runs the processors, expands the placeholders by the resulting grids and tokenises with the chat
template. Out come transformers' keyword arguments: ``input_ids``, ``attention_mask``,
``labels``, ``mm_token_type_ids``, and when present ``pixel_values`` / ``image_grid_thw``,
``pixel_values_videos`` / ``video_grid_thw`` / ``second_per_grid_ts``. A missing or unreadable
medium, or a sample that cannot fit ``max_length``, raises `BadSample`. With ``pairs`` every sample
is a preference pair (`mm_data.vl.pairs`: both answers to one prompt, its media processed once);
without it pair data is refused, and with it an entry that is no pair is a `BadSample`. With
``prompts`` every sample is a prompt with its reference answer (`mm_data.vl.prompts`: GRPO).
"""

from __future__ import annotations

import functools
import io
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from mm_data.errors import BadInputLog, BadSample, bytes_source
from mm_data.shards import ShardEntries, ShardSet
from mm_data.video.decode import VideoInfo, probe, read_frames
from mm_data.vl.conversation import Conversation, Medium, read_conversations, read_datasets, shard_conversations
from mm_data.vl.image_processor import Qwen2VLImageProcessor, smart_resize
from mm_data.vl.pairs import PAIR_INDEX, encode_pair, pair_length
from mm_data.vl.prompts import PROMPT_INDEX, encode_prompt
from mm_data.vl.template import QWEN_MEDIA, QwenChatTemplate
from mm_data.vl.video_processor import Qwen2VLVideoProcessor

# fields holding media patches: batches concatenate them along the first axis instead of stacking
MEDIA_FIELDS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


def load_image(source: Medium):
    """An image file (a path or its bytes) as an RGB PIL image."""
    from PIL import Image

    try:
        with Image.open(source if isinstance(source, str) else io.BytesIO(source)) as image:
            return image.convert("RGB")
    except FileNotFoundError:
        raise BadSample(source, "file not found") from None
    except Exception as error:  # PIL raises several error classes for broken files
        raise BadSample(_named(source), f"unreadable image: {error}") from None


def image_size(source: Medium) -> Tuple[int, int]:
    """(height, width) from the image's header."""
    from PIL import Image

    try:
        with Image.open(source if isinstance(source, str) else io.BytesIO(source)) as image:
            width, height = image.size
    except Exception as error:
        raise BadSample(_named(source), f"unreadable image: {error}") from None
    return height, width


def named_by_row(method):
    """A medium given as bytes that fails is named by its sample's row (a shard's ``shard[row]``)."""
    @functools.wraps(method)
    def named(self, index, *args, **kwargs):
        try:
            return method(self, index, *args, **kwargs)
        except BadSample as bad:
            if not bad.unnamed:
                raise
            raise BadSample(self.source(index), f"{bad.source}: {bad.reason}") from None
    return named


def _named(source: Medium) -> str:
    return source if isinstance(source, str) else bytes_source("image", source)


class VLSFTDataset:
    """See the module docstring."""

    media = QWEN_MEDIA  # the chat template's media tokens
    media_fields = MEDIA_FIELDS  # joined along the first axis by the collator, not stacked

    def __init__(self, conversations: Sequence[Conversation], tokenizer, image_processor=None, video_processor=None,
                 max_length: Optional[int] = None, video_fps: float = 2.0,
                 default_system: Optional[str] = "You are a helpful assistant.",
                 bad_input: Optional[BadInputLog] = None, pairs: bool = False, prompts: bool = False):
        if pairs and prompts:
            raise ValueError("a data set holds preference pairs (dpo) or prompts (grpo), not both")
        lazy = isinstance(conversations, ShardEntries)  # parsed when read: the first block tells the kind
        self.conversations, self.pairs, self.prompts = conversations if lazy else list(conversations), pairs, prompts
        found = sum(c.rejected is not None for c in (self._first_block() if lazy else self.conversations))
        if found and not pairs:
            raise ValueError(f"the data holds {found} preference pairs (chosen / rejected answers): train on them with "
                             "a preference objective (mm-train: train.objective dpo), or give SFT conversations")
        if pairs and self.conversations and not found:
            raise ValueError("a preference objective needs pairs: entries with chosen and rejected answers "
                             "(LLaMA-Factory's ranking format); this data holds none")
        # default_system None or "": no system turn unless the data has one
        self.template = QwenChatTemplate(tokenizer, default_system, media=self.media)
        self.image_processor = image_processor or Qwen2VLImageProcessor()
        self.video_processor = video_processor or Qwen2VLVideoProcessor()
        self.max_length, self.video_fps = max_length, video_fps
        self.bad_input = bad_input if bad_input is not None else BadInputLog(total=len(self.conversations))

    @classmethod
    def from_file(cls, path, tokenizer, media_dir: Optional[str] = None, max_bad_fraction: float = 0.05,
                  data_format: str = "json", **kwargs):
        """The data set of a LLaMA-Factory file, of data sets of a dataset_info.json (``path``: a
        list of `mm_data.vl.dataset_info.DatasetFormat`, read in order), or with ``data_format``
        parquet | webdataset | arrow of shards (`mm_data.shards.ShardSet.open`: a folder, glob or
        manifest), each row read when its sample is."""
        log, prompts = BadInputLog(max_bad_fraction), kwargs.get("prompts", False)
        if data_format != "json":
            conversations = shard_conversations(ShardSet.open(path, data_format), media_dir, prompts=prompts)
            log.total = len(conversations)
        else:
            conversations = (read_conversations(path, media_dir, log, prompts=prompts) if isinstance(path, str)
                             else read_datasets(path, media_dir, log, prompts=prompts))
        return cls(conversations, tokenizer, bad_input=log, **kwargs)

    def _first_block(self) -> List[Conversation]:
        """The first block's usable conversations (what a sharded set's kind is judged by)."""
        shards, parsed = self.conversations.shards, []
        for index in range(shards.block_sizes[0] if len(shards) else 0):
            try:
                parsed.append(self.conversations[index])
            except BadSample:
                continue
        return parsed

    @property
    def shards(self) -> Optional[ShardSet]:
        """The shards the samples are read from, or None (a JSON file)."""
        return self.conversations.shards if isinstance(self.conversations, ShardEntries) else None

    def __len__(self) -> int:
        return len(self.conversations)

    def source(self, index: int) -> str:
        shards = self.shards
        return shards.source(index) if shards is not None else self.conversations[index].source

    def _video(self, path: Medium, info: VideoInfo) -> tuple:
        processor = self.video_processor
        fps = None if processor.num_frames is not None else (processor.fps or self.video_fps)
        try:
            indices = processor.sample_frames(info.num_frames, info.fps, fps=fps)
        except ValueError as error:
            raise BadSample(info.path, str(error)) from None
        frames = read_frames(path, indices)
        sampled_fps = len(indices) / info.num_frames * info.fps
        return frames, processor.temporal_patch_size / sampled_fps, _timestamps(processor, indices, info.fps)

    @named_by_row
    def get(self, index: int, epoch: int = 0) -> Dict[str, np.ndarray]:
        conversation = self.conversations[index]
        if conversation.audios:
            raise BadSample(conversation.source, "audio inputs need the Qwen2.5-Omni data set (mm_data.vl.omni)")
        sample, image_tokens, video_tokens, timestamps, seconds = self.vision(conversation)
        if conversation.videos and not timestamps:  # Qwen2.5-VL: time enters the temporal positions
            sample["second_per_grid_ts"] = seconds
        tokens = self.tokens(conversation, lambda c, limit: self.template.encode(
            c, image_tokens, video_tokens, max_length=limit, video_timestamps=timestamps))
        sample.update(tokens)
        sample["attention_mask"] = np.ones_like(tokens["input_ids"])
        return self.indexed(sample, index)

    def indexed(self, sample: Dict[str, np.ndarray], index: int) -> Dict[str, np.ndarray]:
        """A pair's or a prompt's sample with its index in the data set (a reference cache's, a
        rollout's key)."""
        if self.pairs:
            sample[PAIR_INDEX] = np.int64(index)
        if self.prompts:
            sample[PROMPT_INDEX] = np.int64(index)
        return sample

    def solution(self, index: int) -> Optional[str]:
        """Prompt ``index``'s reference answer (mm_data.vl.prompts), or None."""
        return self.conversations[index].solution

    def vision(self, conversation: Conversation):
        """(the processors' outputs, image pad counts, video pad counts, each video's timestamps when
        its processor writes them, each video's seconds per temporal patch) of a conversation."""
        sample: Dict[str, np.ndarray] = {}
        merge = self.image_processor.merge_size ** 2
        image_tokens: List[int] = []
        if conversation.images:
            pictures = [load_image(path) for path in conversation.images]
            for path, picture in zip(conversation.images, pictures):
                try:
                    self.image_processor.target_size(picture)
                except ValueError as error:  # e.g. an aspect ratio beyond 200: the sample, not the run, is bad
                    raise BadSample(_named(path), f"image not processable: {error}") from None
            images = self.image_processor(pictures)
            sample.update(images)
            image_tokens = [int(np.prod(grid)) // merge for grid in images["image_grid_thw"]]
        video_tokens: List[int] = []
        timestamps: List[List[float]] = []
        seconds = None
        if conversation.videos:
            decoded = [self._video(path, self.video_info(conversation, number))
                       for number, path in enumerate(conversation.videos)]
            try:
                videos = self.video_processor([frames for frames, _, _ in decoded])
            except ValueError as error:
                raise BadSample(conversation.source, f"video not processable: {error}") from None
            sample.update(videos)
            timestamps = [stamps for _, _, stamps in decoded if stamps is not None]
            seconds = np.array([per_grid for _, per_grid, _ in decoded], np.float32)
            merge_v = self.video_processor.merge_size ** 2
            video_tokens = [int(np.prod(grid)) // merge_v for grid in videos["video_grid_thw"]]
        return sample, image_tokens, video_tokens, timestamps, seconds

    def __getitem__(self, index: int) -> Dict[str, np.ndarray]:
        return self.get(index)

    def collator(self, pad_to_multiple_of: int = 1):
        """Pads token fields (input_ids with the tokenizer's pad id, to a multiple of
        ``pad_to_multiple_of``), concatenates media fields."""
        from mm_data.loader import Collator

        pad_id = getattr(self.template.tokenizer, "pad_token_id", None) or 0
        return Collator(pad_values={"input_ids": pad_id}, concatenate=self.media_fields,
                        pad_to_multiple_of=pad_to_multiple_of)

    @named_by_row
    def length(self, index: int) -> int:
        """Tokens of sample ``index``, from image headers and video probes (no pixels decoded)."""
        conversation = self.conversations[index]
        image_tokens, video_tokens, timestamps, _, _ = self.vision_from_headers(conversation)
        return pair_length(self.tokens(conversation, lambda c, limit: self.template.encode(
            c, image_tokens, video_tokens, max_length=limit, video_timestamps=timestamps)))

    def tokens(self, conversation: Conversation, encode) -> Dict[str, np.ndarray]:
        """``encode(conversation, max_length)`` (the template's token fields); with ``pairs`` both
        sides of the pair, uncut (`mm_data.vl.pairs.encode_pair`); with ``prompts`` the prompt,
        uncut (`mm_data.vl.prompts.encode_prompt`)."""
        if self.prompts:
            return encode_prompt(lambda c: encode(c, None), conversation, self.max_length)
        if not self.pairs:
            return encode(conversation, self.max_length)
        if conversation.rejected is None:
            raise BadSample(conversation.source, "not a preference pair (no chosen and rejected answers); "
                                                 "preference training reads pairs only")
        return encode_pair(lambda c: encode(c, None), conversation, self.max_length)

    @named_by_row
    def costs(self, index: int):
        """(tokens, vision tokens) of sample ``index`` from headers and probes: what data-parallel
        ranks are balanced by (`BucketBatchSampler` with ``costs``)."""
        image_tokens, video_tokens, *_ = self.vision_from_headers(self.conversations[index])
        return self.length(index), sum(image_tokens) + sum(video_tokens)

    def vision_from_headers(self, conversation: Conversation):
        """What `vision` gives but the pixels, from image headers and video probes: (image pad
        counts, video pad counts, each video's timestamps when its processor writes them, video
        grids (t, h, w), each video's seconds per temporal patch, float32 as `vision` gives them)."""
        images, videos = self.image_processor, self.video_processor
        image_tokens = []
        for number, path in enumerate(conversation.images):
            height, width = self.image_size(conversation, number)
            try:
                h, w = smart_resize(height, width, images.patch_size * images.merge_size,
                                    images.size["shortest_edge"], images.size["longest_edge"])
            except ValueError as error:
                raise BadSample(_named(path), f"image not processable: {error}") from None
            image_tokens.append(h * w // (images.patch_size * images.merge_size) ** 2)
        video_tokens, timestamps, grids, seconds = [], [], [], []
        for number, path in enumerate(conversation.videos):
            info = self.video_info(conversation, number)
            fps = None if videos.num_frames is not None else (videos.fps or self.video_fps)
            try:
                indices = videos.sample_frames(info.num_frames, info.fps, fps=fps)
            except ValueError as error:
                raise BadSample(info.path, str(error)) from None
            count, stamps = len(indices), _timestamps(videos, indices, info.fps)
            if stamps is not None:
                timestamps.append(stamps)
            try:
                h, w = videos.target_size(count, info.height, info.width)
            except ValueError as error:
                raise BadSample(conversation.source, f"video not processable: {error}") from None
            grids.append([-(-count // videos.temporal_patch_size), h // videos.patch_size, w // videos.patch_size])
            video_tokens.append(int(np.prod(grids[-1])) // videos.merge_size ** 2)
            seconds.append(videos.temporal_patch_size / (count / info.num_frames * info.fps))  # as `_video`
        return image_tokens, video_tokens, timestamps, grids, np.array(seconds, np.float32)


    @staticmethod
    def image_size(conversation: Conversation, number: int) -> Tuple[int, int]:
        """(height, width) of the conversation's image ``number``: its media_info, else its header."""
        known = (conversation.media_info or {}).get("images")
        if known:
            return int(known[number][0]), int(known[number][1])
        return image_size(conversation.images[number])

    @staticmethod
    def video_info(conversation: Conversation, number: int) -> VideoInfo:
        """Frames, fps and size of the conversation's video ``number``: its media_info, else a probe."""
        known, path = (conversation.media_info or {}).get("videos"), conversation.videos[number]
        if known:
            frames, fps, height, width = known[number]
            name = path if isinstance(path, str) else f"{conversation.source} video {number}"
            return VideoInfo(name, int(frames), float(fps), int(height), int(width))
        return probe(path)


def _timestamps(processor, indices, video_fps) -> Optional[List[float]]:
    """The seconds of each temporal patch when the processor writes them into the text (Qwen3-VL)."""
    return processor.timestamps(indices, video_fps) if hasattr(processor, "timestamps") else None
