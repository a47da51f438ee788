"""Whisper log-mel features in numpy: the twin of transformers' WhisperFeatureExtractor with the
settings Qwen2.5-Omni's processor uses (128 mel bins, 16 kHz, n_fft 400, hop 160, audio up to
chunk_length = 300 s, padding "max_length", an attention mask per frame).

For an audio of L samples (float32, truncated to chunk_length seconds) transformers computes

    S = |STFT(pad(x, to n_samples), n_fft, hop, periodic Hann, centred, reflect)|^2  minus its last frame
    M = log10(max(mel_filters^T S, 1e-10));   M = max(M, max(M) - 8);   features = (M + 4) / 4

over all n_samples / hop frames (30000: five minutes, whatever the audio's length) and marks the
first ceil(L / hop) of them real. The frames past the audio's end only add silence (log10 1e-10),
which never raises max(M); so the real frames come from the frames that touch the audio alone:
here only those ceil((L + n_fft / 2) / hop) frames are transformed, then the first ceil(L / hop)
are returned, padded across a batch to its longest ("longest", the default: the thinker reads only
the masked frames) or to the full 30000 ("max_length", transformers' output shape).

The STFT runs in float64 (numpy's pocketfft), the mel filters are transformers' slaney bank in
float64; transformers' torch path computes in float32, within 1e-5 of this (tested on many lengths).
"""

from __future__ import annotations

from typing import Dict, Sequence

import numpy as np

FRAMES_PER_BLOCK = 1024  # 3 MiB of float64 spectra per block: measured 3-4x faster than whole-clip arrays


def hertz_to_mel(freq: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz (3 mel per 200 Hz), logarithmic above."""
    freq = np.asarray(freq, np.float64)
    logstep = 27.0 / np.log(6.4)
    return np.where(freq >= 1000.0, 15.0 + np.log(np.maximum(freq, 1e-12) / 1000.0) * logstep, 3.0 * freq / 200.0)


def mel_to_hertz(mels: np.ndarray) -> np.ndarray:
    mels = np.asarray(mels, np.float64)
    logstep = np.log(6.4) / 27.0
    return np.where(mels >= 15.0, 1000.0 * np.exp(logstep * (mels - 15.0)), 200.0 * mels / 3.0)


def slaney_mel_filters(num_frequency_bins: int, num_mel_filters: int, sampling_rate: int,
                       min_frequency: float = 0.0, max_frequency: float = 8000.0) -> np.ndarray:
    """(num_frequency_bins, num_mel_filters) triangular filters, slaney-normalised (equal area)."""
    mel_points = np.linspace(hertz_to_mel(min_frequency), hertz_to_mel(max_frequency), num_mel_filters + 2)
    edges = mel_to_hertz(mel_points)
    fft_freqs = np.linspace(0, sampling_rate // 2, num_frequency_bins)
    slopes = edges[None, :] - fft_freqs[:, None]
    widths = np.diff(edges)
    down, up = -slopes[:, :-2] / widths[:-1], slopes[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    return filters * (2.0 / (edges[2:] - edges[:-2]))[None, :]


class WhisperFeatureExtractor:
    """See the module docstring. Arguments as transformers' (and Qwen2.5-Omni's preprocessor_config.json)."""

    def __init__(self, feature_size: int = 128, sampling_rate: int = 16000, hop_length: int = 160,
                 chunk_length: int = 300, n_fft: int = 400, padding_value: float = 0.0):
        self.feature_size, self.sampling_rate, self.hop_length = feature_size, sampling_rate, hop_length
        self.chunk_length, self.n_fft, self.padding_value = chunk_length, n_fft, padding_value
        self.n_samples = chunk_length * sampling_rate
        self.nb_max_frames = self.n_samples // hop_length
        self.mel_filters = slaney_mel_filters(1 + n_fft // 2, feature_size, sampling_rate)
        self.window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)  # periodic Hann

    @classmethod
    def from_dict(cls, config: dict) -> "WhisperFeatureExtractor":
        """From a preprocessor_config.json's dict (transformers' names; others ignored)."""
        names = ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft", "padding_value")
        return cls(**{k: config[k] for k in names if k in config})

    def to_dict(self) -> dict:
        return {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": self.feature_size,
                "sampling_rate": self.sampling_rate, "hop_length": self.hop_length,
                "chunk_length": self.chunk_length, "n_fft": self.n_fft, "n_samples": self.n_samples,
                "nb_max_frames": self.nb_max_frames, "padding_value": self.padding_value,
                "return_attention_mask": True, "dither": 0.0}

    def frames(self, samples: int) -> int:
        """Real feature frames of an audio of ``samples`` samples (what the attention mask marks)."""
        return min(-(-int(samples) // self.hop_length), self.nb_max_frames)

    def log_mel(self, waveform: np.ndarray) -> np.ndarray:
        """(feature_size, frames(len)) features of one mono waveform."""
        features, real = self._touching_frames(waveform)
        return features[:, :real]

    def _touching_frames(self, waveform: np.ndarray):
        """(features of every frame that touches the audio, how many of them are real)."""
        x = np.asarray(waveform, np.float32).reshape(-1)[:self.n_samples].astype(np.float64)
        if x.size == 0:
            raise ValueError("an audio needs at least one sample")
        half, hop = self.n_fft // 2, self.hop_length
        last = self.n_samples // hop  # the padded signal's last frame, which transformers drops
        count = min(-(-(x.size + half) // hop), last)
        needed = (count - 1) * hop + self.n_fft  # samples of the centred signal those frames read
        if needed - half < self.n_samples:  # the frames end before the padded signal does: zeros, no end mirror
            signal = np.zeros(max(needed - half, half + 1))
            signal[:x.size] = x
            centred = np.concatenate([signal[half:0:-1], signal])
        else:
            centred = np.pad(np.pad(x, (0, self.n_samples - x.size)), half, mode="reflect")
        windows = np.lib.stride_tricks.as_strided(centred, (count, self.n_fft), (hop * centred.itemsize,
                                                                                centred.itemsize))
        mel = np.empty((count, self.feature_size))
        for start in range(0, count, FRAMES_PER_BLOCK):  # blocks: temporaries stay small (no page faults)
            spectrum = np.fft.rfft(windows[start:start + FRAMES_PER_BLOCK] * self.window, axis=-1)
            power = np.square(spectrum.real) + np.square(spectrum.imag)  # |z|^2 without abs's square root
            np.matmul(power, self.mel_filters, out=mel[start:start + FRAMES_PER_BLOCK])
        np.log10(np.maximum(mel, 1e-10, out=mel), out=mel)
        np.maximum(mel, mel.max() - 8.0, out=mel)
        features = np.empty((self.feature_size, count), np.float32)
        np.multiply(mel.T + 4.0, 0.25, out=features, casting="same_kind")
        return features, self.frames(x.size)

    def __call__(self, audios: Sequence[np.ndarray], sampling_rate: int = None,
                 padding: str = "longest") -> Dict[str, np.ndarray]:
        """``input_features`` (audios, feature_size, frames) and ``attention_mask`` (audios, frames):
        padded to the longest audio with ``padding_value``, or with "max_length" to nb_max_frames
        with transformers' values (the frames past the audio as transformers computes them)."""
        if sampling_rate is not None and sampling_rate != self.sampling_rate:
            raise ValueError(f"audio at {sampling_rate} Hz given to a feature extractor for {self.sampling_rate} "
                             f"Hz: resample it first (mm_data.audio.load_audio does)")
        if padding not in ("longest", "max_length"):
            raise ValueError(f"padding must be 'longest' or 'max_length', got {padding!r}")
        computed = [self._touching_frames(audio) for audio in audios]
        width = self.nb_max_frames if padding == "max_length" else max(real for _, real in computed)
        out = np.full((len(computed), self.feature_size, width), self.padding_value, np.float32)
        mask = np.zeros((len(computed), width), np.int32)
        for i, (features, real) in enumerate(computed):
            mask[i, :real] = 1
            if padding == "max_length":  # silence frames: log10(1e-10) raised to the floor max - 8
                out[i] = max(-10.0, float(features.max()) * 4.0 - 12.0) / 4.0 + 1.0
                out[i, :, :features.shape[1]] = features
            else:
                out[i, :, :real] = features[:, :real]
        return {"input_features": out, "attention_mask": mask}
