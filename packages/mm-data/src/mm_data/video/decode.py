"""Video files through PyAV: probe the stream, decode only the frames a clip needs.

`read_frames` seeks to the first wanted frame (the demuxer lands on the keyframe before it) and
decodes forward, stopping after the last wanted frame, so a 4-second clip of a 10-minute video
costs a few seconds of decoding, not ten minutes. Frames are numbered from their timestamps,
``round((pts - start) * time_base * fps)``, which is what a decode of every frame would count,
and are converted (and, if asked, resized by swscale) to RGB uint8 as they come out.
Anything wrong with the file becomes a `BadSample`, never a crash or a hang of the caller.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Sequence, Tuple

import numpy as np

from mm_data.errors import BadSample


@dataclass(frozen=True)
class VideoInfo:
    """What the container says about its first video stream."""

    path: str
    num_frames: int
    fps: float
    height: int
    width: int

    @property
    def duration(self) -> float:
        return self.num_frames / self.fps


def _open(path: str):
    import av

    if not os.path.isfile(path):
        raise BadSample(path, "file not found")
    if os.path.getsize(path) == 0:
        raise BadSample(path, "empty file")
    try:
        container = av.open(path, metadata_errors="ignore")
    except Exception as error:  # PyAV raises many FFmpeg error classes; all mean "unreadable"
        raise BadSample(path, f"cannot open: {error}") from None
    if not container.streams.video:
        container.close()
        raise BadSample(path, "no video stream")
    return container


def _frame_rate(stream) -> Fraction:
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    if not rate or rate <= 0:
        raise BadSample(stream.container.name, "the video stream has no frame rate")
    return Fraction(rate)


def probe(path: str) -> VideoInfo:
    """Frame count, fps and size from the container header (no decoding unless it has no count)."""
    container = _open(path)
    try:
        stream = container.streams.video[0]
        fps = _frame_rate(stream)
        frames = stream.frames
        if not frames:  # some containers (webm, raw streams) do not store it
            if stream.duration is not None and stream.time_base:
                frames = int(round(stream.duration * stream.time_base * fps))
            elif container.duration:
                frames = int(round(container.duration / 1_000_000 * fps))
        width, height = stream.codec_context.width, stream.codec_context.height
    finally:
        container.close()
    if not frames or frames <= 0:
        raise BadSample(path, "zero-length video")
    if not width or not height:
        raise BadSample(path, "the video stream has no frame size")
    return VideoInfo(str(path), int(frames), float(fps), int(height), int(width))


def read_frames(path: str, indices: Sequence[int], size: Optional[Tuple[int, int]] = None,
                interpolation: str = "BICUBIC") -> np.ndarray:
    """Frames ``indices`` (ascending, repeats allowed) as (T, H, W, 3) uint8 RGB.

    ``size`` = (height, width) resizes each frame with swscale's ``interpolation`` while converting.
    Raises `BadSample` if the file cannot be decoded or ends before the last wanted frame.
    """
    indices = np.asarray(indices, np.int64)
    if indices.size == 0:
        raise BadSample(path, "no frames requested")
    if np.any(np.diff(indices) < 0) or indices[0] < 0:
        raise ValueError(f"frame indices must be non-negative and ascending, got {indices.tolist()}")
    wanted = np.unique(indices)
    wanted_set = set(wanted.tolist())
    container = _open(path)
    found = {}
    try:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        fps, time_base = _frame_rate(stream), stream.time_base
        start_pts = stream.start_time or 0
        first = int(wanted[0])
        if first > 0:
            # seek lands on the keyframe at or before this timestamp; decoding forward from there
            container.seek(start_pts + int((first - Fraction(1, 2)) / fps / time_base), stream=stream, backward=True,
                           any_frame=False)
        reformat = {"format": "rgb24"}
        if size is not None:
            reformat.update(height=int(size[0]), width=int(size[1]), interpolation=interpolation)
        last, counter = int(wanted[-1]), 0
        for frame in container.decode(stream):
            index = counter if frame.pts is None else int(round((frame.pts - start_pts) * time_base * fps))
            counter = index + 1
            if index > last:
                break
            if index in found or index not in wanted_set:
                continue
            found[index] = frame.to_ndarray(**reformat)
            if len(found) == wanted.size:
                break
    except BadSample:
        raise
    except Exception as error:  # corrupt packets surface as FFmpeg errors mid-decode
        raise BadSample(path, f"decoding failed: {error}") from None
    finally:
        container.close()
    missing = [int(i) for i in wanted if int(i) not in found]
    if missing:
        raise BadSample(path, f"video ends early or is corrupt: frames {missing[:5]}{'...' if len(missing) > 5 else ''}"
                              f" of the clip could not be decoded")
    return np.stack([found[int(i)] for i in indices])
