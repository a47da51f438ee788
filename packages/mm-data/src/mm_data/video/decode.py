"""Video files through PyAV: probe the stream, decode only the frames a clip needs.

`read_frames` seeks to the first wanted frame (the demuxer lands on the keyframe before it) and
decodes forward, stopping after the last wanted frame, so a 4-second clip of a 10-minute video
costs a few seconds of decoding, not ten minutes. Frame ``i`` is the picture on screen at
``i / fps`` after the first decoded frame, as a player shows it: frames are numbered
``round((pts - origin) * time_base * fps)`` from the first frame the decoder outputs (not the
stream's start_time: AVI's first H.264 frame often has pts 1 with start 0, and a clip cut with
stream copy starts with packets that cannot be decoded), a gap in the timestamps repeats the frame
before it, and a file whose timestamps do not increase in output order (AVI's packed B-frames) or
are missing (raw streams) is numbered by counting, from the start. Packets that fail to decode
before the first picture are skipped, as FFmpeg does. Frames are converted (and, if asked,
resized by swscale) to RGB uint8 as they come out. Anything wrong with the file becomes a
`BadSample`, never a crash or a hang of the caller.

A source is a path or the file's bytes (a sample inside a shard).
"""

from __future__ import annotations

import io
import os
from collections import OrderedDict
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Sequence, Tuple, Union

import numpy as np

from mm_data.errors import BadSample, bytes_source

Source = Union[str, bytes]
# AVI stores no presentation timestamps: FFmpeg stamps its packets in decode order, so with
# B-frames the decoded frames' pts come out of order. For these containers the first frames are
# decoded to see it (x264's default pyramid reorders within 4); other containers store each
# frame's pts, and their first frame is enough. Measured on 320 x 240 H.264: a 17-frame clip read
# takes 31 ms, 37 ms when it is the file's first read in the process (the look), 38 ms when the
# look opened the file a second time, 41 ms when it decoded 8 frames.
_DECODE_ORDER_STAMPS = {"avi"}
_TIMELINE_FRAMES = 8
_TIMELINES: "OrderedDict[tuple, _Timeline]" = OrderedDict()
_TIMELINE_CACHE = 4096


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


@dataclass(frozen=True)
class _Timeline:
    """How a file numbers its frames: ``origin`` is the pts of the first frame a decoder outputs;
    ``stamped`` says the timestamps increase in output order (seek and number by them), else
    frames are counted from the start."""

    origin: int
    stamped: bool


def _name(source: Source) -> str:
    return source if isinstance(source, str) else bytes_source("video", source)


def _open(source: Source):
    import av

    if isinstance(source, str):
        if not os.path.isfile(source):
            raise BadSample(source, "file not found")
        if os.path.getsize(source) == 0:
            raise BadSample(source, "empty file")
    elif not source:
        raise BadSample(_name(source), "empty file")
    try:
        container = av.open(source if isinstance(source, str) else io.BytesIO(source), metadata_errors="ignore")
    except Exception as error:  # PyAV raises many FFmpeg error classes; all mean "unreadable"
        raise BadSample(_name(source), f"cannot open: {error}") from None
    if not container.streams.video:
        container.close()
        raise BadSample(_name(source), "no video stream")
    container.streams.video[0].thread_type = "AUTO"  # before the first decode opens the codec
    return container


def _frames(container, stream):
    """Decoded frames in output order; packets that fail before the first picture are skipped
    (a stream copy cut before a keyframe), later failures raise."""
    import av

    shown = False
    for packet in container.demux(stream):
        try:
            frames = packet.decode()
        except av.error.InvalidDataError:
            if shown:
                raise
            continue
        for frame in frames:
            shown = True
            yield frame


def _frame_rate(stream) -> Fraction:
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    if not rate or rate <= 0:
        raise BadSample(stream.container.name, "the video stream has no frame rate")
    return Fraction(rate)


def _file_key(source: Source):
    if not isinstance(source, str):
        return None  # bytes from a shard: no identity to cache under
    try:
        stat = os.stat(source)
    except OSError:
        return None  # `_open` says what is wrong
    return source, stat.st_size, stat.st_mtime_ns


def _timeline(source: Source, container=None) -> _Timeline:
    """The first frames' timestamps (cached per file: path, size, mtime). Read from ``container``
    when given (the caller rewinds it with `_rewound`: a second open costs more than the look),
    else from a container of its own."""
    key = _file_key(source)
    if key is not None and key in _TIMELINES:
        _TIMELINES.move_to_end(key)
        return _TIMELINES[key]
    own = container is None
    container = _open(source) if own else container
    stamps = []
    try:
        look = _TIMELINE_FRAMES if container.format.name in _DECODE_ORDER_STAMPS else 1
        for frame in _frames(container, container.streams.video[0]):
            stamps.append(frame.pts)
            if len(stamps) == look:
                break
    except Exception as error:
        raise BadSample(_name(source), f"decoding failed: {error}") from None
    finally:
        if own:
            container.close()
    if not stamps:
        raise BadSample(_name(source), "no frame could be decoded")
    stamped = None not in stamps and all(b > a for a, b in zip(stamps, stamps[1:]))
    timeline = _Timeline(stamps[0] if stamped else 0, stamped)
    if key is not None:
        _TIMELINES[key] = timeline
        if len(_TIMELINES) > _TIMELINE_CACHE:
            _TIMELINES.popitem(last=False)
    return timeline


def _rewound(source: Source, container):
    """``container`` back at its start, or a new one where the input cannot seek (a raw stream's bytes)."""
    try:
        container.seek(0)
        return container
    except Exception:
        container.close()
        return _open(source)


def _last_pts(container, stream) -> Optional[int]:
    """The largest packet timestamp after a seek to the last keyframe (demuxed, not decoded)."""
    end = (stream.start_time or 0) + (stream.duration or int(Fraction(container.duration or 0, 1_000_000)
                                                               / stream.time_base))
    try:
        container.seek(max(end, 0), stream=stream, backward=True, any_frame=False)
        stamps = [packet.pts for packet in container.demux(stream) if packet.pts is not None and packet.size]
    except Exception:  # a demuxer that cannot seek: fall back to the header's count
        return None
    return max(stamps) if stamps else None


def _count_frames(source: Source) -> int:
    container = _open(source)
    try:
        return sum(1 for _ in _frames(container, container.streams.video[0]))
    except Exception as error:
        raise BadSample(_name(source), f"decoding failed: {error}") from None
    finally:
        container.close()


def probe(source: Source) -> VideoInfo:
    """Frame count (from the first decoded frame to the last packet's timestamp), fps and size.

    Decodes the first few frames (`_timeline`) and demuxes the last keyframe's packets; only a
    file without usable timestamps is decoded whole to count its frames."""
    container = _open(source)
    try:
        timeline = _timeline(source, container)  # its look decodes from this container; _last_pts seeks on
        stream = container.streams.video[0]
        fps = _frame_rate(stream)
        width, height = stream.codec_context.width, stream.codec_context.height
        header_frames = stream.frames
        last = _last_pts(container, stream) if timeline.stamped else None
        time_base = stream.time_base
    finally:
        container.close()
    if last is not None:
        frames = int(round((last - timeline.origin) * time_base * fps)) + 1
    elif timeline.stamped and header_frames:
        frames = header_frames
    else:
        frames = _count_frames(source)
    if not frames or frames <= 0:
        raise BadSample(_name(source), "zero-length video")
    if not width or not height:
        raise BadSample(_name(source), "the video stream has no frame size")
    return VideoInfo(_name(source), int(frames), float(fps), int(height), int(width))


def read_frames(source: Source, indices: Sequence[int], size: Optional[Tuple[int, int]] = None,
                interpolation: str = "BICUBIC") -> np.ndarray:
    """Frames ``indices`` (ascending, repeats allowed) as (T, H, W, 3) uint8 RGB.

    ``size`` = (height, width) resizes each frame with swscale's ``interpolation`` while converting.
    Raises `BadSample` if the file cannot be decoded or ends before the last wanted frame.
    """
    indices = np.asarray(indices, np.int64)
    if indices.size == 0:
        raise BadSample(_name(source), "no frames requested")
    if np.any(np.diff(indices) < 0) or indices[0] < 0:
        raise ValueError(f"frame indices must be non-negative and ascending, got {indices.tolist()}")
    wanted = np.unique(indices)
    reformat = {"format": "rgb24"}
    if size is not None:
        reformat.update(height=int(size[0]), width=int(size[1]), interpolation=interpolation)
    container = _open(source)
    try:
        cached = _file_key(source) in _TIMELINES
        timeline = _timeline(source, container)
        if not cached:
            container = _rewound(source, container)
        found = _decode_wanted(container, timeline, wanted, reformat)
    except BadSample:
        raise
    except Exception as error:  # corrupt packets surface as FFmpeg errors mid-decode
        raise BadSample(_name(source), f"decoding failed: {error}") from None
    finally:
        container.close()
    missing = [int(i) for i in wanted if int(i) not in found]
    if missing:
        raise BadSample(_name(source), f"video ends early or is corrupt: frames {missing[:5]}"
                                       f"{'...' if len(missing) > 5 else ''} of the clip could not be decoded")
    return np.stack([found[int(i)] for i in indices])


def _decode_wanted(container, timeline: _Timeline, wanted: np.ndarray, reformat: dict) -> dict:
    """{index: RGB frame} for the ``wanted`` indices: seek (when timestamps allow), then decode forward."""
    stream = container.streams.video[0]
    fps, time_base = _frame_rate(stream), stream.time_base
    first, last = int(wanted[0]), int(wanted[-1])
    if timeline.stamped and first > 0:
        # seek lands on the keyframe at or before this timestamp; decoding forward from there
        container.seek(timeline.origin + int((first - Fraction(1, 2)) / fps / time_base), stream=stream,
                       backward=True, any_frame=False)
    wanted_set, found = set(wanted.tolist()), {}
    shown, shown_index, counter = None, None, 0
    for frame in _frames(container, stream):
        stamped = timeline.stamped and frame.pts is not None
        index = int(round((frame.pts - timeline.origin) * time_base * fps)) if stamped else counter
        counter = index + 1
        if shown is not None:  # a gap in the timestamps: the frame before stays on screen
            for held in range(shown_index + 1, min(index, last + 1)):
                if held in wanted_set and held not in found:
                    found[held] = shown.to_ndarray(**reformat)
        if index > last:
            break
        if index in wanted_set and index not in found:
            found[index] = frame.to_ndarray(**reformat)
            if len(found) == len(wanted_set):
                break
        shown, shown_index = frame, index
    return found
