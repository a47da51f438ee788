"""Clip decoding with PyAV equals decoding every frame; clip sampling math; annotation layouts."""

import json
import os
from fractions import Fraction

import numpy as np
import pytest
from helpers.media import decode_all, truncate, write_awkward_videos, write_video

from mm_data.errors import BadInputLog, BadSample, DataError
from mm_data.video import AspectBuckets, FrameBuckets, clip_indices, frames_available, load_records, probe, read_frames


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    root = tmp_path_factory.mktemp("videos")
    return {
        "h264": write_video(str(root / "a.mp4"), 60, 50, 66, 24, "libx264", gop=12),      # odd size
        "mpeg4": write_video(str(root / "b.mp4"), 45, 48, 64, Fraction(30000, 1001), "mpeg4", gop=15),
        "h264_25": write_video(str(root / "c.mkv"), 31, 36, 90, 25, "libx264", gop=7),
        "vp9": write_video(str(root / "d.webm"), 20, 32, 32, 12, "libvpx-vp9", gop=5),
    }


@pytest.mark.parametrize("name", ["h264", "mpeg4", "h264_25", "vp9"])
def test_clip_frames_equal_decoding_every_frame(videos, name):
    path = videos[name]
    info = probe(path)
    full = decode_all(path)
    assert (info.num_frames, info.height, info.width) == full.shape[:3]
    rng = np.random.default_rng(0)
    cases = [[0], [info.num_frames - 1], list(range(5)), [3, 3, 4, 4]]  # repeats = fps upsampling
    for _ in range(6):  # starts past keyframes, strides like fps resampling
        step = float(rng.uniform(0.5, 3.0))
        length = int(rng.integers(1, frames_available(info.num_frames, step) + 1))
        cases.append(clip_indices(info.num_frames, length, step, rng).tolist())
    for indices in cases:
        assert np.array_equal(read_frames(path, indices), full[indices]), indices
    resized = decode_all(path, (20, 30))  # swscale resize while converting, as in a full decode
    assert np.array_equal(read_frames(path, [1, info.num_frames - 2], size=(20, 30)),
                          resized[[1, info.num_frames - 2]])


AWKWARD = ["avi_h264_pts1", "avi_h264_bframes", "avi_mpeg4", "mkv_offset", "h264_raw", "mkv_cut", "mov_cut", "webm_cut"]


@pytest.fixture(scope="module")
def awkward(tmp_path_factory):
    return write_awkward_videos(tmp_path_factory.mktemp("awkward"))


@pytest.mark.parametrize("name", AWKWARD)
def test_every_frame_of_files_players_play_equals_a_plain_decode(awkward, name):
    """LLaMA-Factory's 2.avi case (H.264 in AVI, first pts 1, start_time 0), AVI's reordered
    B-frame timestamps, frame-counter timestamps, a late start, a raw stream without timestamps and
    stream copies cut before a keyframe (MKV, MOV, WebM): the probe counts the frames a plain decode
    yields, every frame and clips from any start equal it, from the file and from its bytes."""
    path = awkward[name]
    full = decode_all(path)
    assert probe(path).num_frames == len(full)
    n = len(full)
    assert np.array_equal(read_frames(path, range(n)), full)
    rng = np.random.default_rng(1)
    cases = [[n - 1], [n // 2, n // 2 + 1], list(range(5, n, 4))]
    cases += [clip_indices(n, int(rng.integers(2, 12)), float(rng.uniform(0.5, 2.5)), rng).tolist() for _ in range(4)]
    for indices in cases:
        assert np.array_equal(read_frames(path, indices), full[indices]), indices
    with open(path, "rb") as f:
        data = f.read()
    assert probe(data).num_frames == n  # bytes are never cached: each read looks at the first frames, rewinds
    assert np.array_equal(read_frames(data, range(n)), full)
    assert np.array_equal(read_frames(data, cases[-1]), full[cases[-1]])


def test_a_gap_in_the_timestamps_holds_the_frame_before(tmp_path):
    """Timestamps 0, 1, 2, 5, 6, ...: a player shows picture 2 until time 5, so frames 3 and 4
    are picture 2, read from the start or after a seek."""
    path = write_video(str(tmp_path / "gap.mkv"), 10, 48, 64, 12, stamps=[0, 1, 2, 5, 6, 7, 8, 9, 10, 11])
    pictures = decode_all(path)
    shown = pictures[[0, 1, 2, 2, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert probe(path).num_frames == len(shown)
    assert np.array_equal(read_frames(path, range(len(shown))), shown)
    assert np.array_equal(read_frames(path, [3, 4, 5]), shown[[3, 4, 5]])


def test_bad_videos_raise_bad_sample(videos, tmp_path):
    with pytest.raises(BadSample, match="not found"):
        probe(str(tmp_path / "missing.mp4"))
    (tmp_path / "empty.mp4").write_bytes(b"")
    with pytest.raises(BadSample, match="empty"):
        probe(str(tmp_path / "empty.mp4"))
    (tmp_path / "garbage.mp4").write_bytes(os.urandom(5000))
    with pytest.raises(BadSample):
        probe(str(tmp_path / "garbage.mp4"))
    cut = truncate(videos["h264"], str(tmp_path / "cut.mp4"), 0.4)
    with pytest.raises(BadSample):  # header (moov) may be gone, or the frames past the cut
        read_frames(cut, [0, 59])
    with pytest.raises(BadSample, match="ends early"):
        read_frames(videos["mpeg4"], [44, 60])


def test_clip_sampling_matches_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(200):
        n, step = int(rng.integers(1, 80)), float(rng.choice([0.5, 1.0, 1.5, 24 / 16, 30000 / 1001 / 16, 2.0, 3.0]))
        most = max(t for t in range(1, 200) if np.floor((t - 1) * step + 1e-9) <= n - 1)
        assert frames_available(n, step) == most, (n, step)
        indices = clip_indices(n, most, step, rng)
        assert indices[0] >= 0 and indices[-1] <= n - 1 and np.all(np.diff(indices) >= 0)
        centred = clip_indices(n, most, step)
        assert centred[0] == (n - 1 - int(np.floor((most - 1) * step + 1e-9))) // 2
    buckets = FrameBuckets(num_frames=17, min_frames=5)
    assert [buckets.fit(a) for a in (0, 1, 4, 5, 8, 9, 16, 17, 100)] == [0, 1, 1, 5, 5, 9, 13, 17, 17]
    with pytest.raises(BadSample, match="too short"):
        buckets.length(4, "short.mp4")
    with pytest.raises(ValueError, match="1 \\+ 4 \\* n"):
        FrameBuckets(num_frames=16)


def test_aspect_buckets():
    buckets = AspectBuckets(max_area=64 * 96, stride=16)
    for height, width in [(480, 640), (1080, 1920), (1920, 1080), (500, 500), (100, 250)]:
        bh, bw = buckets.bucket(height, width)
        assert bh % 16 == 0 and bw % 16 == 0 and bh * bw <= 64 * 96
        assert abs(np.log(bh / bw) - np.log(height / width)) < 0.25
    assert buckets.bucket(1080, 1920) == buckets.bucket(720, 1280)
    with pytest.raises(BadSample, match="max_aspect"):
        buckets.bucket(10, 100)
    wan = AspectBuckets(sizes=[(480, 832), (832, 480)])
    assert wan.bucket(720, 1280) == (480, 832) and wan.bucket(1000, 600) == (832, 480)
    with pytest.raises(ValueError, match="multiples of stride"):
        AspectBuckets(sizes=[(470, 832)])


def test_annotation_layouts(videos, tmp_path):
    folder = os.path.dirname(videos["h264"])
    entries = [{"path": "a.mp4", "cap": "a cat", "num_frames": 60, "fps": 24,
                "resolution": {"height": 50, "width": 66}},
               {"path": "b.mp4", "cap": ["one", "two"]},
               {"path": "nope.mp4", "cap": "missing"},
               {"path": "c.mkv"},  # no caption
               "not an object"]
    (tmp_path / "data.json").write_text(json.dumps(entries))
    (tmp_path / "data.txt").write_text(f"{folder},data.json\n{folder},{tmp_path / 'data.json'}\n")
    log = BadInputLog(max_bad_fraction=1.0)
    records = load_records(str(tmp_path / "data.txt"), log)
    assert [os.path.basename(r.path) for r in records] == ["a.mp4", "b.mp4"] * 2
    assert records[0].has_metadata and records[0].captions == ("a cat",) and records[1].captions == ("one", "two")
    assert log.count == 3 and log.total == 7  # the same bad entries count once per source

    lines = [json.dumps({"file": os.path.relpath(videos["h264"], tmp_path), "captions": ["x"]}), "{broken",
             json.dumps({"video": os.path.relpath(videos["vp9"], tmp_path), "text": "y"})]
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    log = BadInputLog(max_bad_fraction=0.5)
    records = load_records(str(tmp_path / "data.jsonl"), log)
    assert [r.captions for r in records] == [("x",), ("y",)] and log.count == 1 and "malformed" in log.skipped[0][1]
    with pytest.raises(DataError, match="data.jsonl:2"):
        load_records(str(tmp_path / "data.jsonl"), BadInputLog(max_bad_fraction=0.2))

    # MindSpeed-MM's data.json: its dataset config naming the jsonl and the folder paths start from
    config = {"dataset_param": {"dataset_type": "t2v", "basic_parameters": {
        "data_path": "data.jsonl", "data_folder": ".", "data_storage_mode": "standard"}}}
    (tmp_path / "mindspeed").mkdir()
    (tmp_path / "mindspeed" / "data.json").write_text(json.dumps(config, indent=1))
    lines = [json.dumps({"file": os.path.relpath(videos["h264"], tmp_path / "mindspeed"), "captions": "x"}),
             json.dumps({"file": "missing.mp4", "captions": "y"})]
    (tmp_path / "mindspeed" / "data.jsonl").write_text("\n".join(lines) + "\n")
    log = BadInputLog(max_bad_fraction=0.5)
    records = load_records(str(tmp_path / "mindspeed" / "data.json"), log)
    assert [(os.path.realpath(r.path), r.captions) for r in records] == [(os.path.realpath(videos["h264"]), ("x",))]
    assert log.count == 1 and "file not found" in log.skipped[0][1]

    (tmp_path / "set" / "videos").mkdir(parents=True)
    (tmp_path / "set" / "labels").mkdir()
    for name in ("a.mp4", "b.mp4"):
        os.link(os.path.join(folder, name), tmp_path / "set" / "videos" / name)
    (tmp_path / "set" / "labels" / "a.txt").write_text("caption of a\n")
    log = BadInputLog(max_bad_fraction=0.5)
    records = load_records(str(tmp_path / "set"), log)
    assert [(os.path.basename(r.path), r.captions) for r in records] == [("a.mp4", ("caption of a",))]
    assert log.count == 1 and "no caption file" in log.skipped[0][1]
    with pytest.raises(ValueError, match="layout"):
        load_records(str(tmp_path / "data.csv"))
    (tmp_path / "object.json").write_text('{"path": "a.mp4"}')
    with pytest.raises(ValueError, match="one JSON dict"):
        load_records(str(tmp_path / "object.json"))
    (tmp_path / "broken.json").write_text('[{"path": "a.mp4"},')
    with pytest.raises(ValueError, match="not valid JSON"):
        load_records(str(tmp_path / "broken.json"))
