"""Qwen2.5-Omni SFT data (mm_data.vl.omni): LLaMA-Factory samples with audios and videos carrying
their audio become the thinker's inputs; a batch runs through transformers' thinker, the
interleaving equals transformers' processor's, the features equal transformers' Whisper features."""

import json

import numpy as np
import pytest
from helpers.media import OMNI_SPECIAL, qwen_tokenizer, tone, write_audio, write_image, write_video

from mm_data import BucketBatchSampler, DataLoader
from mm_data.audio import WhisperFeatureExtractor, load_audio
from mm_data.errors import BadSample
from mm_data.vl import OMNI_SYSTEM, OmniSFTDataset, Qwen2VLImageProcessor, Qwen2VLVideoProcessor, video_audio_runs

TEXTS = ["What do you hear?", "A tone.", "Describe the clip.", "A bar moves while a tone plays.", OMNI_SYSTEM]
PPS, CHUNK = 4, 1  # position ids per second; seconds per chunk (short, so a 2 s clip makes several chunks)


def _transformers_runs(grid, merge, seconds, pads, pps, chunk):
    """The processor's own interleaving (Qwen2_5OmniProcessor.replace_video_with_audio_token's cut)."""
    from transformers import Qwen2_5OmniProcessor

    t, h, w = grid
    video = np.repeat(np.arange(t), (h // merge) * (w // merge)) * seconds * pps
    per_chunk = int(pps * chunk)
    video_chunks = Qwen2_5OmniProcessor.get_chunked_index(None, video, per_chunk)
    audio_chunks = Qwen2_5OmniProcessor.get_chunked_index(None, np.arange(pads), per_chunk)
    runs = []
    for j in range(max(len(video_chunks), len(audio_chunks))):
        if j < len(video_chunks):
            runs.append(("video", video_chunks[j][1] - video_chunks[j][0]))
        if j < len(audio_chunks):
            runs.append(("audio", audio_chunks[j][1] - audio_chunks[j][0]))
    return [(kind, n) for kind, n in runs if n]


def test_interleaving_equals_transformers_processor():
    rng = np.random.default_rng(0)
    for _ in range(200):
        grid = (int(rng.integers(1, 9)), 2 * int(rng.integers(1, 5)), 2 * int(rng.integers(1, 5)))
        seconds, pads = float(rng.choice([0.5, 1.0, 1.3, 2.0, 0.25])), int(rng.integers(1, 300))
        pps, chunk = int(rng.choice([4, 25])), float(rng.choice([0.5, 1.0, 2.0]))
        assert video_audio_runs(grid, 2, seconds, pads, pps, chunk) == _transformers_runs(grid, 2, seconds, pads, pps,
                                                                                          chunk)


@pytest.fixture(scope="module")
def omni_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("omni")
    tokenizer = qwen_tokenizer(str(root / "tok"), TEXTS, special=OMNI_SPECIAL)
    write_audio(str(root / "a.wav"), tone(1.3, 44100), 44100)
    write_audio(str(root / "b.flac"), tone(0.6, 16000, 880.0), 16000, "flac")
    write_audio(str(root / "clip.mp4"), tone(2.0, 22050, 300.0), 22050, "aac", video_frames=20)  # 2 s, 10 fps
    write_image(str(root / "p.png"), 56, 56, 0)
    write_video(str(root / "silent.mp4"), 20, 32, 32, 10, "mpeg4")
    (root / "empty.wav").write_bytes(b"")
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    reply = lambda text: {"role": "assistant", "content": text}  # noqa: E731
    entries = [
        {"messages": [user("<audio>What do you hear?"), reply("A tone.")], "audios": ["a.wav"]},
        {"messages": [user("<image>and<audio><audio>?"), reply("A tone.")], "images": ["p.png"],
         "audios": ["b.flac", "a.wav"]},
        {"messages": [user("<video>Describe the clip."), reply("A bar moves while a tone plays.")],
         "videos": ["clip.mp4"]},
        {"messages": [user("<audio><video>What?"), reply("A tone.")], "audios": ["b.flac"], "videos": ["clip.mp4"]},
        {"messages": [user("<audio>x"), reply("y")], "audios": ["missing.wav"]},
        {"messages": [user("<audio>x"), reply("y")], "audios": ["empty.wav"]},
        {"messages": [user("<video>x"), reply("y")], "videos": ["silent.mp4"]}]
    (root / "data.json").write_text(json.dumps(entries))
    dataset = OmniSFTDataset.from_file(
        str(root / "data.json"), tokenizer, max_bad_fraction=0.5, use_audio_in_video=True,
        position_id_per_seconds=PPS, seconds_per_chunk=CHUNK, video_fps=4.0,
        image_processor=Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=4 * 28 * 28),
        video_processor=Qwen2VLVideoProcessor(min_pixels=28 * 28, max_pixels=4 * 28 * 28))
    return root, tokenizer, dataset


def test_samples_hold_the_processor_layout_and_whisper_features(omni_set):
    from transformers import WhisperFeatureExtractor as Reference

    root, tokenizer, dataset = omni_set
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in OMNI_SPECIAL}
    reference = Reference(feature_size=128, chunk_length=300, return_attention_mask=True)
    second = dataset.get(1)  # an image, then two audios in text order: b.flac, a.wav
    frames = second["feature_attention_mask"].sum(-1)
    assert frames.tolist() == [60, 130] and second["input_features"].shape == (2, 128, 130)
    for row, name in enumerate(["b.flac", "a.wav"]):
        wave = load_audio(str(root / name))
        want = reference([wave], sampling_rate=16000, padding="max_length", return_attention_mask=True)
        numpy_path = reference._np_extract_fbank_features(np.pad(wave, (0, reference.n_samples - wave.size))[None],
                                                          "cpu")
        got = second["input_features"][row, :, :frames[row]]
        gap = np.abs(numpy_path[0, :, :frames[row]] - want["input_features"][0, :, :frames[row]]).max()
        assert np.abs(got - want["input_features"][0, :, :frames[row]]).max() <= gap + 1e-6
    tokens = second["input_ids"].tolist()
    assert tokens.count(ids["<|AUDIO|>"]) == 15 + 32  # (60 -> 30 -> 15), (130 -> 65 -> 32)
    assert tokens.count(ids["<|IMAGE|>"]) == 4  # 56 x 56 px: 2 x 2 merged patches
    assert tokenizer.decode(tokens).startswith(f"<|im_start|>system\n{OMNI_SYSTEM}<|im_end|>")

    clip = dataset.get(2)  # a video with its own audio, interleaved
    assert clip["video_grid_thw"].tolist() == [[4, 2, 2]] and clip["video_second_per_grid"].tolist() == [0.5]
    pads = int((clip["feature_attention_mask"].sum() - 1) // 2 + 1 - 2) // 2 + 1
    runs = _transformers_runs((4, 2, 2), 2, 0.5, pads, PPS, CHUNK)
    assert len(runs) > 4  # several chunks of each
    pad = {"video": ids["<|VIDEO|>"], "audio": ids["<|AUDIO|>"]}
    expected = [ids["<|vision_bos|>"], ids["<|audio_bos|>"]] + [pad[k] for k, n in runs for _ in range(n)]
    expected += [ids["<|audio_eos|>"], ids["<|vision_eos|>"]]
    start = tokens_start = clip["input_ids"].tolist().index(ids["<|vision_bos|>"])
    assert clip["input_ids"].tolist()[tokens_start:start + len(expected)] == expected
    assert "mm_token_type_ids" not in clip
    labels = clip["labels"][clip["labels"] != -100]
    assert tokenizer.decode(labels) == "A bar moves while a tone plays.<|im_end|>\n"


def test_lengths_decode_no_pixels_and_equal_the_samples(omni_set, monkeypatch):
    """`length` (what packing plans with) from image headers, video probes and the audios alone:
    equal to the tokens `get` makes, for audios, an image, a video with its own audio interleaved
    (with and without use_audio_in_video), and a bad sample is the same named skip."""
    import mm_data.vl.dataset as vl_dataset
    from mm_data.vl.packing import PackedDataset

    _, _, dataset = omni_set
    want = [len(dataset.get(i)["input_ids"]) for i in range(4)]
    without = OmniSFTDataset(dataset.conversations[:4], dataset.template.tokenizer, dataset.image_processor,
                             dataset.video_processor, position_id_per_seconds=PPS, seconds_per_chunk=CHUNK,
                             video_fps=4.0)
    want_without = [len(without.get(i)["input_ids"]) for i in range(4)]

    def no_pixels(*args, **kwargs):
        raise AssertionError("length decoded pixels or computed audio features")

    monkeypatch.setattr(vl_dataset, "read_frames", no_pixels)
    monkeypatch.setattr(vl_dataset, "load_image", no_pixels)
    monkeypatch.setattr(WhisperFeatureExtractor, "_touching_frames", no_pixels)
    assert [dataset.length(i) for i in range(4)] == want
    assert [without.length(i) for i in range(4)] == want_without and want_without[2] < want[2]  # no audio pads
    for index, reason in [(4, "file not found"), (5, "empty file"), (6, "no audio stream")]:
        with pytest.raises(BadSample, match=reason):
            dataset.length(index)
    packed = PackedDataset(without, max_length=max(want_without) + min(want_without))  # two share a row
    monkeypatch.undo()
    assert sorted(i for members in packed.packs for i in members) == [0, 1, 2, 3] and len(packed) < 4
    assert [len(packed.get(k)["input_ids"]) for k in range(len(packed))] == packed.lengths


def test_bad_audio_is_a_named_skip(omni_set):
    _, _, dataset = omni_set
    for index, reason in [(4, "file not found"), (5, "empty file"), (6, "no audio stream")]:
        with pytest.raises(BadSample, match=reason):
            dataset.get(index)
    loader = DataLoader(dataset, BucketBatchSampler(len(dataset), 7, seed=0), collate=dataset.collator())
    batch = next(iter(loader))
    assert batch["input_ids"].shape[0] == 7 and dataset.bad_input.count == 3


def test_batch_runs_through_transformers_thinker(omni_set):
    """The collated batch (ragged audios padded, media concatenated) through transformers'
    thinker with use_audio_in_video, which checks every placeholder against its features."""
    import torch
    from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

    _, tokenizer, dataset = omni_set
    batch = dataset.collator()([dataset.get(i) for i in range(4)])
    assert batch["input_features"].shape[0] == batch["feature_attention_mask"].shape[0] == 6
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in OMNI_SPECIAL}
    config = Qwen2_5OmniThinkerConfig(
        text_config=dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=len(tokenizer),
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                           window_size=56, fullatt_block_indexes=[0]),
        audio_config=dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64,
                          d_model=32, n_window=50, output_dim=64, max_source_positions=1500),
        audio_token_index=ids["<|AUDIO|>"], image_token_index=ids["<|IMAGE|>"], video_token_index=ids["<|VIDEO|>"],
        audio_start_token_id=ids["<|audio_bos|>"], audio_end_token_id=ids["<|audio_eos|>"],
        vision_start_token_id=ids["<|vision_bos|>"], vision_end_token_id=ids["<|vision_eos|>"],
        position_id_per_seconds=PPS, seconds_per_chunk=CHUNK)
    torch.manual_seed(0)
    model = Qwen2_5OmniThinkerForConditionalGeneration(config).eval()
    with torch.no_grad():
        out = model(**{k: torch.from_numpy(v) for k, v in batch.items()}, use_audio_in_video=True)
    assert torch.isfinite(out.loss) and out.logits.shape[:2] == batch["input_ids"].shape


def test_features_of_a_batch_are_each_audios_own():
    ours = WhisperFeatureExtractor()
    a, b = tone(0.3, 16000), tone(1.0, 16000, 880.0)
    batch = ours([a, b])
    np.testing.assert_array_equal(batch["input_features"][0, :, :30], ours([a])["input_features"][0])


def test_an_audio_longer_than_the_features_chunk_is_cut_counted_and_logged(tmp_path, caplog):
    """Whisper features cover chunk_length seconds (300 for Qwen2.5-Omni; 1 here): a longer audio
    keeps its first chunk_length seconds, as transformers' extractor cuts it — never silently."""
    import logging

    tokenizer = qwen_tokenizer(str(tmp_path / "tok"), TEXTS, special=OMNI_SPECIAL)
    write_audio(str(tmp_path / "long.wav"), tone(2.5, 16000), 16000)
    write_audio(str(tmp_path / "short.wav"), tone(0.5, 16000), 16000)
    entries = [{"messages": [{"role": "user", "content": "<audio>What do you hear?"},
                             {"role": "assistant", "content": "A tone."}], "audios": [name]}
               for name in ("long.wav", "short.wav", "long.wav")]
    (tmp_path / "data.json").write_text(json.dumps(entries))
    dataset = OmniSFTDataset.from_file(str(tmp_path / "data.json"), tokenizer,
                                       audio_processor=WhisperFeatureExtractor(chunk_length=1))
    with caplog.at_level(logging.WARNING, logger="mm_data"):
        samples = [dataset.get(i) for i in range(3)]
    assert list(dataset.cut_audio) == [str(tmp_path / "long.wav")]
    assert dataset.cut_audio[str(tmp_path / "long.wav")] == pytest.approx(2.5, abs=0.01)
    cut = [r.getMessage() for r in caplog.records if "only its first 1 s" in r.getMessage()]
    assert len(cut) == 1 and "long.wav is 2.5 s long" in cut[0]  # logged once per file
    assert samples[0]["feature_attention_mask"].sum() == 100  # 1 s of 10 ms frames
    assert samples[1]["feature_attention_mask"].sum() == 50


def test_converted_shards_give_the_samples_and_lengths_without_decoding_audio(omni_set, tmp_path, monkeypatch):
    """`mm-data convert` of the Omni set to Parquet (media embedded; the missing and the empty
    audio left out and named): samples equal the JSON's, field for field, under use_audio_in_video;
    lengths come from media_info's audio sample counts (no audio decoded); the video without an
    audio track is still a named bad sample."""
    from mm_data.shards.convert import convert

    root, tokenizer, dataset = omni_set
    report = convert(str(root / "data.json"), str(tmp_path / "out"), "parquet", rows_per_shard=3, rows_per_block=2)
    assert report["rows"] == 5 and [reason for _, reason in report["skipped"]] == ["file not found", "empty file"]
    sharded = OmniSFTDataset.from_file(
        str(tmp_path / "out"), tokenizer, max_bad_fraction=0.5, use_audio_in_video=True, data_format="parquet",
        position_id_per_seconds=PPS, seconds_per_chunk=CHUNK, video_fps=4.0,
        image_processor=Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=4 * 28 * 28),
        video_processor=Qwen2VLVideoProcessor(min_pixels=28 * 28, max_pixels=4 * 28 * 28))
    for index in range(4):
        expected, got = dataset.get(index), sharded.get(index)
        assert sorted(got) == sorted(expected) and all(np.array_equal(got[k], expected[k]) for k in expected)
    lengths = [dataset.length(i) for i in range(4)]

    def decoded(*args, **kwargs):
        raise AssertionError("an audio was decoded for a length")
    monkeypatch.setattr("mm_data.vl.omni.load_audio", decoded)
    assert [sharded.length(i) for i in range(4)] == lengths
    with pytest.raises(BadSample, match="without an audio track"):
        sharded.length(4)
