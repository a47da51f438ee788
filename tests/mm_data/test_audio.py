"""mm_data.audio: PyAV decoding to 16 kHz mono and the numpy Whisper features, against
transformers' WhisperFeatureExtractor with Qwen2.5-Omni's settings (128 mel bins, 300 s)."""

import numpy as np
import pytest
from helpers.media import tone, truncate, write_audio, write_video

from mm_data.audio import WhisperFeatureExtractor, load_audio
from mm_data.errors import BadSample


def test_mel_filters_equal_transformers():
    from transformers.audio_utils import mel_filter_bank

    from mm_data.audio.features import slaney_mel_filters

    for bins, mels, rate in [(201, 128, 16000), (201, 80, 16000), (257, 40, 8000)]:
        expected = mel_filter_bank(bins, mels, 0.0, 8000.0 if rate == 16000 else 4000.0, rate, norm="slaney",
                                   mel_scale="slaney")
        got = slaney_mel_filters(bins, mels, rate, max_frequency=8000.0 if rate == 16000 else 4000.0)
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-15)


LENGTHS = [1, 150, 160, 161, 199, 200, 201, 400, 401, 16000, 16037, 48093, 160000,
           4_800_000 - 250, 4_800_000 - 100, 4_800_000 + 500]  # a sample to past 300 s (cut to it)


def test_features_equal_transformers_on_many_lengths():
    """Same attention mask; every frame of transformers' max_length output within float32 rounding
    of its numpy path (1e-6), and no farther from its torch path (float32 STFT) than its numpy path
    is (+1e-6); "longest" padding gives the same real frames."""
    from transformers import WhisperFeatureExtractor as Reference

    reference = Reference(feature_size=128, chunk_length=300, return_attention_mask=True)
    ours = WhisperFeatureExtractor()
    rng = np.random.default_rng(0)
    for length in LENGTHS:
        x = (0.1 * rng.standard_normal(length) + 0.5 * np.sin(np.arange(length) * 0.05)).astype(np.float32)
        expected = reference([x], sampling_rate=16000, padding="max_length", return_attention_mask=True)
        got = ours([x], sampling_rate=16000, padding="max_length")
        np.testing.assert_array_equal(got["attention_mask"], expected["attention_mask"])
        cut = np.pad(x[:reference.n_samples], (0, max(0, reference.n_samples - length)))[None]
        numpy_path = reference._np_extract_fbank_features(cut, "cpu")
        assert np.abs(got["input_features"] - numpy_path).max() <= 1e-6, length
        torch_gap = np.abs(numpy_path - expected["input_features"]).max()
        assert np.abs(got["input_features"] - expected["input_features"]).max() <= torch_gap + 1e-6, length
        real = int(got["attention_mask"].sum())
        longest = ours([x])
        assert longest["input_features"].shape == (1, 128, real)
        np.testing.assert_array_equal(longest["input_features"], got["input_features"][:, :, :real])


def test_batch_pads_to_the_longest_with_per_audio_normalisation():
    ours = WhisperFeatureExtractor()
    rng = np.random.default_rng(1)
    quiet, loud = 0.01 * rng.standard_normal(3000), rng.standard_normal(8000)
    batch = ours([quiet, loud])
    assert batch["input_features"].shape == (2, 128, 50)
    assert batch["attention_mask"].sum(-1).tolist() == [19, 50]
    np.testing.assert_array_equal(batch["input_features"][0, :, :19], ours.log_mel(quiet))
    assert not np.any(batch["input_features"][0, :, 19:])
    with pytest.raises(ValueError, match="resample"):
        ours([quiet], sampling_rate=44100)


def test_wav_at_16k_mono_decodes_exactly(tmp_path):
    wave = tone(0.7, 16000)
    got = load_audio(write_audio(str(tmp_path / "a.wav"), wave, 16000, channels=1))
    np.testing.assert_array_equal(got, (wave * 32767).astype(np.int16) / np.float32(32768))


@pytest.mark.parametrize("name, codec, rate, container_format", [
    ("a.wav", "pcm_s16le", 44100, None), ("a.flac", "flac", 48000, None), ("a.mp3", "libmp3lame", 44100, None),
    ("a.m4a", "aac", 22050, "mp4"), ("a.ogg", "libopus", 48000, None)])
def test_formats_decode_to_16k_mono(tmp_path, name, codec, rate, container_format):
    """Stereo files at other rates: 1.5 s at 16 kHz (lossy codecs' priming within 5 %), the tone's
    frequency and the channels' mean amplitude."""
    path = write_audio(str(tmp_path / name), tone(1.5, rate), rate, codec, container_format=container_format)
    got = load_audio(path)
    assert got.dtype == np.float32 and abs(got.size - 24000) <= 0.05 * 24000
    peak = np.argmax(np.abs(np.fft.rfft(got))) * 16000 / got.size
    assert abs(peak - 440.0) < 2.0
    middle = got[got.size // 4: 3 * got.size // 4]
    assert 0.45 < np.abs(middle).max() < 0.55


def test_audio_track_of_a_video_and_bad_files(tmp_path):
    video = write_audio(str(tmp_path / "v.mp4"), tone(1.0, 44100, 300.0), 44100, "aac", video_frames=10)
    track = load_audio(video)
    assert abs(np.argmax(np.abs(np.fft.rfft(track))) * 16000 / track.size - 300.0) < 2.0
    assert load_audio(video, max_seconds=0.5).size == 8000
    silent = write_video(str(tmp_path / "silent.mp4"), frames=5)
    (tmp_path / "empty.wav").write_bytes(b"")
    (tmp_path / "junk.wav").write_bytes(b"not audio at all" * 100)
    bad = {str(tmp_path / "missing.wav"): "file not found", str(tmp_path / "empty.wav"): "empty file",
           silent: "no audio stream", str(tmp_path / "junk.wav"): "cannot"}
    for path, reason in bad.items():
        with pytest.raises(BadSample, match=reason):
            load_audio(path)
    for name, codec in [("long.flac", "flac"), ("long.wav", "pcm_s16le"), ("long.mp3", "libmp3lame")]:
        whole = write_audio(str(tmp_path / name), tone(3.0, 16000), 16000, codec)
        assert abs(load_audio(whole).size - 48000) < 2400
        for fraction in (0.02, 0.5):
            with pytest.raises(BadSample):
                load_audio(truncate(whole, str(tmp_path / f"cut_{fraction}_{name}"), fraction))
