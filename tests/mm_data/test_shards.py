"""Sharded VL data (Parquet written by pyarrow, Hugging Face save_to_disk folders, WebDataset tars
written by the webdataset library) gives the samples the JSON + media files give; shards are read
a block at a time and only where the samples are; damaged shards are named before training; the
block-ordered shuffle resumes at step 100,000 without reading what it skips."""

import json
import os
import time

import numpy as np
import pytest
from helpers.media import qwen_tokenizer, write_image, write_video

from mm_data.errors import BadSample, DataError
from mm_data.loader import DataLoader
from mm_data.sampler import BucketBatchSampler
from mm_data.shards import ShardSet, write_manifest
from mm_data.vl import Qwen2VLImageProcessor, Qwen2VLVideoProcessor, VLSFTDataset

TEXTS = ["What is in the picture?", "A cat on a mat.", "Describe the video.", "A bar moves down.", "Two dogs."]
PROCESSOR = dict(min_pixels=28 * 28, max_pixels=64 * 28 * 28)


def _entries(root):
    """LLaMA-Factory entries with images, a video, several images and none, and one broken entry."""
    images = [write_image(str(root / f"img{i}.png"), 40 + 8 * i, 56 - 4 * i, seed=i) for i in range(4)]
    write_video(str(root / "clip.mp4"), 12, 48, 64, 6, gop=4)
    entries = []
    for n in range(11):
        if n % 4 == 1:
            entry = {"messages": [{"role": "user", "content": "<video>Describe the video."},
                                  {"role": "assistant", "content": "A bar moves down."}], "videos": ["clip.mp4"]}
        elif n % 4 == 2:
            entry = {"messages": [{"role": "user", "content": "<image><image>Two dogs?"},
                                  {"role": "assistant", "content": "Two dogs."}],
                     "images": [os.path.basename(images[n % 4]), os.path.basename(images[(n + 1) % 4])]}
        elif n % 4 == 3:
            entry = {"messages": [{"role": "user", "content": "What is in the picture?"},
                                  {"role": "assistant", "content": "A cat on a mat." * (1 + n % 3)}]}
        else:
            entry = {"conversations": [{"from": "human", "value": "<image>What is in the picture?"},
                                       {"from": "gpt", "value": "A cat on a mat."}],
                     "images": [os.path.basename(images[n % 4])]}
        entries.append(entry)
    entries[6]["images"] = ["img0.png"]  # one image for two placeholders: a bad sample in every format
    return entries


def _embedded(entry, root, kinds=("images",)):
    """The entry with the media of ``kinds`` as Hugging Face {bytes, path} structs (the rest paths)."""
    out = dict(entry)
    for kind in kinds:
        if kind in entry:
            out[kind] = [{"bytes": (root / p).read_bytes(), "path": None} for p in entry[kind]]
    return out


def write_parquet(entries, root, out):
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(out)
    rows = [_embedded(e, root) for e in entries]
    for number, part in enumerate((rows[:7], rows[7:])):
        table = pa.Table.from_pylist([{"messages": r.get("messages"), "conversations": r.get("conversations"),
                                       "images": r.get("images"), "videos": r.get("videos")} for r in part])
        pq.write_table(table, os.path.join(out, f"part-{number}.parquet"), row_group_size=3)
    os.link(root / "clip.mp4", os.path.join(out, "clip.mp4"))  # videos referenced, beside the shards
    return out


def write_arrow(entries, root, out):
    import datasets

    rows = [_embedded(e, root, ("images", "videos")) for e in entries]
    columns = {key: [r.get(key) for r in rows] for key in ("messages", "conversations", "images", "videos")}
    dataset = datasets.Dataset.from_dict(columns).cast_column("images", datasets.List(datasets.Image()))
    dataset.save_to_disk(out, max_shard_size="20KB")
    return out


def write_webdataset(entries, root, out):
    import webdataset

    os.makedirs(out)
    for number, part in enumerate((entries[:5], entries[5:])):
        with webdataset.TarWriter(os.path.join(out, f"shard-{number}.tar")) as tar:
            for n, entry in enumerate(part):
                sample, entry = {"__key__": f"s{number}{n:03d}"}, dict(entry)
                for kind in ("images", "videos"):
                    for i, path in enumerate(entry.get(kind, [])):
                        sample[f"{kind}.{i}{os.path.splitext(path)[1]}"] = (root / path).read_bytes()
                    if kind in entry:
                        entry[kind] = [f"{kind}.{i}{os.path.splitext(p)[1]}" for i, p in enumerate(entry[kind])]
                sample["json"] = entry
                tar.write(sample)
    return out


WRITERS = {"parquet": write_parquet, "arrow": write_arrow, "webdataset": write_webdataset}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl")
    entries = _entries(root)
    (root / "data.json").write_text(json.dumps(entries))
    shards = {fmt: write(entries, root, str(root / fmt)) for fmt, write in WRITERS.items()}
    return root, shards, qwen_tokenizer(str(root / "tok"), TEXTS)


def _dataset(path, tokenizer, fmt="json"):
    return VLSFTDataset.from_file(path, tokenizer, max_length=1024, max_bad_fraction=0.5, data_format=fmt,
                                  image_processor=Qwen2VLImageProcessor(**PROCESSOR),
                                  video_processor=Qwen2VLVideoProcessor(**PROCESSOR), video_fps=2.0)


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_shards_give_the_samples_the_json_and_files_give(data, fmt):
    """Media embedded as bytes (Parquet's and Arrow's {bytes, path} images and Arrow's videos, the
    tar's members) or referenced as paths beside the shards: every sample, its costs and its bad
    samples equal the JSON data set's."""
    root, shards, tokenizer = data
    reference, sharded = _dataset(str(root / "data.json"), tokenizer), _dataset(shards[fmt], tokenizer, fmt)
    assert len(sharded) == len(reference) + 1  # the JSON reader drops the bad entry when reading, shards when asked
    for index in range(len(sharded)):
        if index == 6:
            with pytest.raises(BadSample, match=r"2 <image> placeholders but 1 images"):
                sharded.get(index)
            assert sharded.source(index).startswith(shards[fmt]) and sharded.source(index).endswith("]")
            continue
        expected, got = reference.get(index - (index > 6)), sharded.get(index)
        assert sorted(got) == sorted(expected)
        for key in expected:
            assert np.array_equal(got[key], expected[key]), (index, key)
        assert sharded.costs(index) == reference.costs(index - (index > 6))


def test_a_shard_is_read_a_block_at_a_time_and_only_where_asked(data):
    root, shards, _ = data
    shard_set = ShardSet.open(shards["parquet"], "parquet")
    assert shard_set.block_sizes == [3, 3, 1, 3, 1] and len(shard_set) == 11
    assert shard_set.reads == 0  # opening read footers only
    shard_set.row(4), shard_set.row(5), shard_set.row(3)
    assert shard_set.reads == 1 and shard_set.locate(4) == (1, 1)
    shard_set.row(9)
    assert shard_set.reads == 2 and shard_set.source(9).endswith("part-1.parquet[2]")


def test_damaged_or_missing_shards_are_named_before_training(data, tmp_path):
    import shutil

    root, shards, _ = data
    for fmt, ending in (("parquet", "footer"), ("webdataset", "header"), ("arrow", "stream")):
        copy = tmp_path / fmt
        shutil.copytree(shards[fmt], copy)
        paths = sorted(str(p) for p in copy.rglob("*") if p.suffix in (".parquet", ".tar", ".arrow"))
        manifest = write_manifest(str(copy), fmt, paths)
        assert len(ShardSet.open(manifest, fmt)) == 11  # from the manifest alone
        with open(paths[-1], "r+b") as f:  # cut short by a failed copy
            f.truncate(os.path.getsize(paths[-1]) - 700)
        with pytest.raises(DataError, match=rf"shard {paths[-1]} has \d+ bytes, .*manifest.json says \d+.*copy it"):
            ShardSet.open(str(copy), fmt)
        os.remove(manifest)  # without the manifest the footer / headers give it away
        if fmt != "webdataset":
            with pytest.raises(DataError, match=rf"shard {paths[-1]} is damaged or not an? {fmt}"):
                ShardSet.open(str(copy), fmt)
        os.remove(paths[0])
        write_manifest(str(copy), fmt, paths[1:-1])
        manifest = json.loads((copy / "manifest.json").read_text())
        manifest["shards"].insert(0, {"path": os.path.relpath(paths[0], copy), "bytes": 10, "blocks": [1]})
        (copy / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(DataError, match=rf"shard {paths[0]} is missing"):
            ShardSet.open(str(copy), fmt)
    with pytest.raises(DataError, match="no parquet shards"):
        ShardSet.open(str(tmp_path / "nothing"), "parquet")


class CountingRows:
    """A data set over a ShardSet of `rows` rows in blocks that counts what it decodes."""

    def __init__(self, shard_set):
        from mm_data.errors import BadInputLog

        self.shards, self.bad_input, self.decoded = shard_set, BadInputLog(), 0

    def __len__(self):
        return len(self.shards)

    def get(self, index, epoch=0):
        self.decoded += 1
        return {"value": np.array([self.shards.row(index)["value"]], np.int64)}

    def source(self, index):
        return self.shards.source(index)


def test_block_order_resumes_at_step_100000_without_reading_what_it_skips(tmp_path):
    """80 row groups of 1,000 rows, two samples a step: step 100,000 is in the third epoch. The
    resumed loader's first batch equals the stream's (computed from the sampler alone), under dp 1
    and dp 2, and costs one block read and well under a second."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"value": np.arange(80_000)}), str(tmp_path / "rows.parquet"), row_group_size=1000)
    reference = BucketBatchSampler(80_000, 2, blocks=[1000] * 80, seed=5)
    expected = reference.epoch_batches(2)[100_000 - 2 * 40_000]
    for dp in (1, 2):
        shard_set = ShardSet.open(str(tmp_path), "parquet")
        dataset = CountingRows(shard_set)
        start = time.perf_counter()
        sampler = BucketBatchSampler(80_000, 2, dp_rank=dp - 1, dp_size=dp, blocks=shard_set.block_sizes, seed=5)
        loader = DataLoader(dataset, sampler)
        loader.load_state_dict(sampler.state_at(100_000))
        batch = next(iter(loader))
        took = time.perf_counter() - start
        assert took < 1.0, took
        assert dataset.decoded == 2 // dp and shard_set.reads <= dataset.decoded  # the batch's blocks, nothing before
        assert batch["value"].ravel().tolist() == sampler.local(expected).tolist()
        assert loader.state_dict()["epoch"] == 2


def test_block_order_reads_windows_of_blocks_and_is_the_same_on_every_layout():
    keys = [i % 3 for i in range(6000)]
    epochs = {}
    for dp in (1, 2, 4):
        sampler = BucketBatchSampler(6000, 8, dp_rank=0, dp_size=dp, keys=keys, blocks=[100] * 60, window=4, seed=1)
        epochs[dp] = [b.tolist() for b in sampler.epoch_batches(1)]
        assert all(len({keys[i] for i in batch}) == 1 for batch in sampler.epoch_batches(1))
    assert epochs[1] == epochs[2] == epochs[4]
    flat = np.concatenate(epochs[1])
    assert len(set(flat.tolist())) == len(flat)  # no sample twice
    # a window's worth of samples (400) spans two windows (8 blocks) and the blocks of the 3 keys'
    # carried remainders (measured 12); the global shuffle touches nearly every block
    def blocks_per_stretch(batches):
        flat = np.concatenate(batches)
        return max(len(set((flat[i:i + 400] // 100).tolist())) for i in range(0, len(flat) - 400, 400))
    assert blocks_per_stretch(epochs[1]) <= 16
    assert blocks_per_stretch(BucketBatchSampler(6000, 8, keys=keys, seed=1).epoch_batches(1)) >= 50
    assert epochs[1] != [b.tolist() for b in BucketBatchSampler(6000, 8, keys=keys, blocks=[100] * 60, window=4,
                                                                 seed=1).epoch_batches(2)]


@pytest.mark.parametrize("fmt,media", [("parquet", "embed"), ("webdataset", "embed"), ("parquet", "reference")])
def test_convert_writes_shards_that_give_the_json_samples_without_opening_media_for_costs(data, fmt, media, tmp_path,
                                                                                          monkeypatch, capsys):
    from mm_data.cli import main

    root, _, tokenizer = data
    out = tmp_path / "out"
    assert main(["convert", str(root / "data.json"), str(out), "--format", fmt, "--media", media,
                 "--rows-per-shard", "4", "--rows-per-block", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rows"] == 10 and report["shards"] == 3
    assert [source for source, _ in report["skipped"]] == [f"{root / 'data.json'}[6]"]
    reference, sharded = _dataset(str(root / "data.json"), tokenizer), _dataset(str(out), tokenizer, fmt)
    assert len(sharded) == len(reference) == 10
    if fmt == "parquet":
        assert sharded.shards.block_sizes == [2, 2, 2, 2, 2]
    for index in range(len(reference)):
        expected, got = reference.get(index), sharded.get(index)
        assert sorted(got) == sorted(expected) and all(np.array_equal(got[k], expected[k]) for k in expected)
    costs = [reference.costs(i) for i in range(10)]

    def opened(*_):
        raise AssertionError("a medium was opened for its size")
    monkeypatch.setattr("mm_data.vl.dataset.probe", opened)
    monkeypatch.setattr("mm_data.vl.dataset.image_size", opened)
    assert [sharded.costs(i) for i in range(10)] == costs  # media_info: no header read


def test_inspect_reports_counts_bad_media_histograms_and_padding(data, tmp_path, capsys):
    from PIL import Image

    from mm_data.cli import main

    root, _, tokenizer = data
    tokenizer.save_pretrained(str(tmp_path / "tok"))
    png = tmp_path / "hist.png"
    assert main(["inspect", str(root / "data.json"), "--tokenizer", str(tmp_path / "tok"), "--max-length", "1024",
                 "--max-tokens", "600", "--micro-batch-size", "2", "--png", str(png),
                 "--min-pixels", str(PROCESSOR["min_pixels"]), "--max-pixels", str(PROCESSOR["max_pixels"])]) == 0
    report = json.loads(capsys.readouterr().out)
    reference = _dataset(str(root / "data.json"), tokenizer)
    lengths = [reference.length(i) for i in range(len(reference))]
    assert report["samples"] == 10 and [source for source, _ in report["bad"]] == [f"{root / 'data.json'}[6]"]
    assert report["tokens"]["count"] == 10 and report["tokens"]["max"] == max(lengths)
    assert report["video_frames"]["count"] == 3 and report["video_frames"]["max"] == 12  # 12 frames at 6 fps
    assert report["video_seconds"]["max"] == 2.0
    pairs = [lengths[i:i + 2] for i in range(0, 10, 2)]
    assert report["padded_batches"]["padding"] == round(1 - sum(lengths) / sum(2 * max(p) for p in pairs), 4)
    assert 0 <= report["packing"]["padding"] < 1 and report["packing"]["rows"] >= sum(lengths) / 600
    assert Image.open(png).size[0] == 420


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """write_user_clips' JSONL (six clips without metadata in the annotation, one broken)."""
    from helpers.media import write_user_clips

    root = tmp_path_factory.mktemp("clips")
    write_user_clips(root)
    return root


CLIP_OPTIONS = dict(max_bad_fraction=0.5, fps=8, random_crop=True, seed=3)


def _clip_dataset(path, fmt="json"):
    from mm_data.video import AspectBuckets, FrameBuckets, VideoTextDataset

    return VideoTextDataset.from_annotations(path, data_format=fmt, frames=FrameBuckets(num_frames=9, min_frames=5),
                                             buckets=AspectBuckets(sizes=[(32, 32), (32, 48)]), **CLIP_OPTIONS)


def _same_clips(got, expected):
    assert len(got) == len(expected) and got.keys == expected.keys
    for index in range(len(expected)):
        a, b = got.get(index, epoch=1), expected.get(index, epoch=1)
        assert a["caption"] == b["caption"] and np.array_equal(a["video"], b["video"]), index


@pytest.mark.parametrize("fmt,media", [("parquet", "embed"), ("webdataset", "embed"), ("parquet", "reference")])
def test_converted_clip_shards_give_the_annotations_clips_without_reading_a_clip_to_bucket(clips, fmt, media,
                                                                                          tmp_path, monkeypatch):
    from mm_data.shards.convert import convert

    report = convert(str(clips / "data.jsonl"), str(tmp_path / "out"), fmt, media, rows_per_shard=4, rows_per_block=2)
    assert report["kind"] == "video" and report["rows"] == 6 and len(report["skipped"]) == 1
    expected = _clip_dataset(str(clips / "data.jsonl"))

    def read(*_):
        raise AssertionError("a clip was read to learn its bucket")
    with monkeypatch.context() as patch:  # the rows carry frames, fps and size: buckets without a clip
        patch.setattr("mm_data.video.dataset.clip_source", read)
        patch.setattr("mm_data.video.dataset.probe", read)
        sharded = _clip_dataset(str(tmp_path / "out"), fmt)
    assert sharded.shards.reads == 0
    _same_clips(sharded, expected)
    assert sum(sharded.block_sizes) == 6


def test_clips_from_datasets_and_video2dataset_layouts_are_probed_when_rows_say_nothing(clips, tmp_path):
    """A Hugging Face save_to_disk folder of {caption, video: {bytes, path}} rows, and tars of
    KEY.mp4 + KEY.txt members (video2dataset's layout), written by their own libraries; the broken
    clip is a counted bad sample named by its row."""
    import datasets
    import webdataset

    lines = [json.loads(line) for line in (clips / "data.jsonl").read_text().splitlines()]
    rows = {"caption": [e["captions"][0] for e in lines],
            "video": [{"bytes": (clips / e["file"]).read_bytes(), "path": None} for e in lines]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "arrow"), max_shard_size="60KB")
    os.makedirs(tmp_path / "tars")
    with webdataset.TarWriter(str(tmp_path / "tars" / "clips-0.tar")) as tar:
        for n, entry in enumerate(lines):
            tar.write({"__key__": f"c{n:04d}", "mp4": (clips / entry["file"]).read_bytes(),
                       "txt": entry["captions"][0]})
    expected = _clip_dataset(str(clips / "data.jsonl"))
    for fmt, folder in (("arrow", "arrow"), ("webdataset", "tars")):
        sharded = _clip_dataset(str(tmp_path / folder), fmt)
        assert [source for source, _ in sharded.bad_input.skipped] == [sharded.shards.source(6)]
        _same_clips(sharded, expected)


def test_a_sharded_feature_cache_build_reads_each_ranks_own_blocks(clips, tmp_path):
    from mm_data import FeatureDataset, build_feature_cache
    from mm_data.shards.convert import convert

    convert(str(clips / "data.jsonl"), str(tmp_path / "out"), "parquet", rows_per_shard=6, rows_per_block=1)
    encoders = {"mean": lambda batch: batch["video"].mean(axis=(1, 2, 3, 4), keepdims=False)[:, None]}
    blocks = []
    for rank in (0, 1):
        dataset = _clip_dataset(str(tmp_path / "out"), "parquet")
        build_feature_cache(dataset, encoders, str(tmp_path / "cache"), rank=rank, world_size=2)
        blocks.append(set(dataset.shards._cache))
    assert blocks == [{0, 1, 2}, {3, 4, 5}]  # contiguous shares: no block read by both ranks
    assert len(FeatureDataset(str(tmp_path / "cache"))) == 6


def test_a_corrupt_medium_or_a_missing_member_is_a_bad_sample_named_by_its_row(data, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import webdataset

    root, _, tokenizer = data
    entry = {"messages": [{"role": "user", "content": "<image>What is in the picture?"},
                          {"role": "assistant", "content": "A cat on a mat."}]}
    good = (root / "img0.png").read_bytes()
    rows = [{**entry, "images": [good]}, {**entry, "images": [good[:200]]}]  # the second cut short
    os.makedirs(tmp_path / "pq")
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "pq" / "a.parquet"))
    os.makedirs(tmp_path / "tar")
    with webdataset.TarWriter(str(tmp_path / "tar" / "a.tar")) as tar:
        tar.write({"__key__": "k0", "json": {**entry, "images": ["images.0.png"]}, "images.0.png": good})
        tar.write({"__key__": "k1", "json": {**entry, "images": ["images.0.png"]}})  # its member is missing
    missing = "names 'images.0.png', which is neither one of its members \\(json\\) nor a file beside the shard"
    for fmt, folder, reason in (("parquet", "pq", "unreadable image"), ("webdataset", "tar", missing)):
        dataset = _dataset(str(tmp_path / folder), tokenizer, fmt)
        dataset.get(0)
        with pytest.raises(BadSample, match=reason) as bad:
            dataset.get(1)
        assert bad.value.source == dataset.source(1) and bad.value.source.endswith("[1]"), bad.value.source


def test_inspect_of_clips_reports_frames_buckets_and_what_batches_leave_out(clips, tmp_path, capsys):
    from collections import Counter

    from mm_data.cli import main
    from mm_data.video import AspectBuckets, FrameBuckets, VideoTextDataset

    for fmt, path in (("json", clips / "data.jsonl"), ("parquet", tmp_path / "pq")):
        if fmt == "parquet":
            main(["convert", str(clips / "data.jsonl"), str(path), "--kind", "video"])
            capsys.readouterr()
        assert main(["inspect", str(path), "--kind", "video", "--format", fmt, "--num-frames", "9", "--fps", "8",
                     "--max-area", "1024", "--global-batch-size", "2", "--png", str(tmp_path / "clips.png")]) == 0
        report = json.loads(capsys.readouterr().out)
        reference = VideoTextDataset.from_annotations(str(clips / "data.jsonl"), max_bad_fraction=1.0, fps=8,
                                                      frames=FrameBuckets(num_frames=9),
                                                      buckets=AspectBuckets(max_area=1024, stride=16))
        counts = Counter(reference.keys)
        assert report["video_frames"] == {"count": 6, "min": 18.0, "mean": 21.0, "p50": 20.0, "p95": 25.0,
                                          "max": 25.0}
        assert sorted(report["buckets"].values()) == sorted(counts.values())
        assert report["batches"]["left_out_per_epoch"] == sum(n % 2 for n in counts.values())
        assert len(report["bad"]) == (1 if fmt == "json" else 0)  # convert left the broken clip out
