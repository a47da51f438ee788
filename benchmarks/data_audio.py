"""Audio clips per second through mm_data's Whisper features vs transformers' WhisperFeatureExtractor.

    python benchmarks/data_audio.py [--clips 16] [--min-seconds 2] [--max-seconds 30] [--runs 3]

Both sides use Qwen2.5-Omni's processor settings: 128 mel bins, 16 kHz, chunk_length 300 s, and
transformers padded to "max_length" (what Qwen2_5OmniProcessor asks for), with torch installed (its
float32 torch STFT path, as users run it). Ours returns the real frames only (padded to the longest
clip of a call). Before timing, every clip's real frames are asserted equal to transformers' within
its own float32 noise (no farther from transformers' torch path than transformers' numpy path is,
+1e-6). One clip per call, as a data set's get() makes them; best of ``--runs``; ratio printed.
"""

from __future__ import annotations

import argparse

import numpy as np
from _timing import best_rate


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clips", type=int, default=16)
    parser.add_argument("--min-seconds", type=float, default=2.0)
    parser.add_argument("--max-seconds", type=float, default=30.0)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    from transformers import WhisperFeatureExtractor as Reference

    from mm_data.audio import WhisperFeatureExtractor

    rng = np.random.default_rng(0)
    lengths = rng.integers(int(args.min_seconds * 16000), int(args.max_seconds * 16000) + 1, args.clips)
    clips = [(0.1 * rng.standard_normal(n) + 0.3 * np.sin(np.arange(n) * 0.03)).astype(np.float32) for n in lengths]
    theirs = Reference(feature_size=128, chunk_length=300, return_attention_mask=True)
    ours = WhisperFeatureExtractor()
    run_theirs = lambda clip: theirs([clip], sampling_rate=16000, padding="max_length",  # noqa: E731
                                     return_attention_mask=True)
    for clip in clips:
        want, got = run_theirs(clip), ours([clip], sampling_rate=16000)
        real = int(want["attention_mask"].sum())
        assert got["input_features"].shape[-1] == real
        numpy_path = theirs._np_extract_fbank_features(np.pad(clip, (0, theirs.n_samples - clip.size))[None], "cpu")
        gap = np.abs(numpy_path[..., :real] - want["input_features"][..., :real]).max()
        assert np.abs(got["input_features"] - want["input_features"][..., :real]).max() <= gap + 1e-6
    theirs_rate = best_rate(lambda: [run_theirs(clip) for clip in clips], len(clips), args.runs)
    ours_rate = best_rate(lambda: [ours([clip], sampling_rate=16000) for clip in clips], len(clips), args.runs)
    seconds = lengths.sum() / 16000
    print(f"Whisper log-mel features (Qwen2.5-Omni settings), {len(clips)} clips of {args.min_seconds:g}-"
          f"{args.max_seconds:g} s ({seconds:.0f} s of audio), outputs equal within float32 noise")
    print(f"  transformers (torch STFT, max_length)  {theirs_rate:8.1f} clips/s")
    print(f"  ours (numpy, real frames)              {ours_rate:8.1f} clips/s   ratio {ours_rate / theirs_rate:.2f}"
          f"  (goal >= 3)")


if __name__ == "__main__":
    main()
