"""Audio files (wav, flac, mp3, m4a / aac, ogg, ...) and the audio track of videos through PyAV,
as 16 kHz mono float32 in [-1, 1] (what Whisper features and Qwen2.5-Omni expect).

FFmpeg's resampler converts the sample format and rate as frames come out of the decoder (it is
flushed at the end, so the last milliseconds are kept); channels are then averaged, as librosa's
``load(mono=True)`` (what Qwen's own loading code calls) does. FFmpeg's own downmix would not do:
it mixes stereo as (L + R) / sqrt(2), 1.41x louder than the mean.

A missing, empty or unreadable file, a file without an audio stream, one that decodes to no
samples or to less than 90 % of the duration its header declares (a cut file: FFmpeg decodes what
is there; for WAV, whose duration FFmpeg derives from the file size, the RIFF data chunk's declared
size is checked instead) is a `BadSample`.
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import Callable, Optional, Union

import numpy as np

from mm_data.errors import BadSample, bytes_source


def load_audio(path: Union[str, bytes], sampling_rate: int = 16000, max_seconds: float = None,
               on_cut: Optional[Callable[[str, float], None]] = None) -> np.ndarray:
    """The first audio stream of ``path`` as a (samples,) float32 array at ``sampling_rate`` Hz, mono;
    with ``max_seconds`` decoding stops once that much is read (the rest would be cut anyway), and
    ``on_cut(path, seconds)`` is told when the audio was longer (``seconds``: its declared length,
    or at least what was read when the header gives none)."""
    import av

    if isinstance(path, bytes):  # a sample inside a shard: the file's bytes
        data, path = path, bytes_source("audio", path)
        if not data:
            raise BadSample(path, "empty file")
    else:
        if not os.path.isfile(path):
            raise BadSample(path, "file not found")
        if os.path.getsize(path) == 0:
            raise BadSample(path, "empty file")
        data = None
    missing = _wav_bytes_missing(path if data is None else io.BytesIO(data))
    if missing:
        raise BadSample(path, f"truncated: its WAV data chunk lacks {missing} of the bytes its header declares")
    limit = None if max_seconds is None else int(max_seconds * sampling_rate)
    try:
        container = av.open(path if data is None else io.BytesIO(data), metadata_errors="ignore")
    except Exception as error:  # PyAV raises many FFmpeg error classes; all mean "unreadable"
        raise BadSample(path, f"cannot open: {error}") from None
    try:
        if not container.streams.audio:
            raise BadSample(path, "no audio stream")
        stream = container.streams.audio[0]
        declared = _declared_seconds(container, stream)
        resampler = av.AudioResampler(format="fltp", rate=sampling_rate)  # the stream's own channel layout
        pieces, read = [], 0
        for frame in container.decode(stream):
            for out in resampler.resample(frame):
                pieces.append(out.to_ndarray().mean(0))
                read += pieces[-1].size
            if limit is not None and read >= limit:
                break
        else:
            pieces += [out.to_ndarray().mean(0) for out in resampler.resample(None)]
    except BadSample:
        raise
    except Exception as error:  # a corrupt or truncated stream
        raise BadSample(path, f"cannot decode audio: {error}") from None
    finally:
        container.close()
    samples = np.concatenate(pieces).astype(np.float32, copy=False) if pieces else np.zeros(0, np.float32)
    if samples.size == 0:
        raise BadSample(path, "the audio stream holds no samples")
    seconds = samples.size / sampling_rate
    if declared and (limit is None or samples.size < limit) and seconds < 0.9 * declared:
        raise BadSample(path, f"truncated: the header declares {declared:.2f} s, {seconds:.2f} s decode")
    if limit is None:
        return samples
    if on_cut is not None and (samples.size > limit or (declared or 0) * sampling_rate > limit + sampling_rate / 100):
        on_cut(path, max(declared or 0.0, seconds))
    return samples[:limit]


def _declared_seconds(container, stream):
    """The duration the stream (else the container) header declares, in seconds, or None."""
    if stream.duration is not None and stream.time_base:
        return float(stream.duration * stream.time_base)
    return container.duration / 1_000_000 if container.duration else None


def _wav_bytes_missing(path) -> int:
    """For a RIFF / WAVE file (a path or a file object), how many bytes of its data chunk are
    missing (0 if whole or not WAV)."""
    import struct

    with (open(path, "rb") if isinstance(path, str) else contextlib.nullcontext(path)) as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        header = f.read(12)
        if header[:4] != b"RIFF" or header[8:12] != b"WAVE":
            return 0
        offset = 12
        while offset + 8 <= size:
            f.seek(offset)
            chunk, length = struct.unpack("<4sI", f.read(8))
            if chunk == b"data":
                return max(0, offset + 8 + length - size) if length != 0xFFFFFFFF else 0  # streamed: unknown
            offset += 8 + length + (length & 1)
    return 0
