"""VideoTextDataset, the bucketed sampler, the loader's workers and bad-input handling, the feature cache."""

import json
import os
import time

import numpy as np
import pytest
from helpers.media import bpe_tokenizer, decode_all, truncate, write_video

from mm_data.errors import BadSample, DataError
from mm_data.feature_cache import FeatureDataset, build_feature_cache
from mm_data.loader import Collator, DataLoader
from mm_data.sampler import BucketBatchSampler, length_groups
from mm_data.video import AspectBuckets, FrameBuckets, VideoTextDataset
from mm_data.video.spatial import cover_size

CAPTIONS = ["a red bar moves down", "blue fades to the right", "a green line on red", "frames count up",
            "a wide landscape clip", "a tall portrait clip"]
# (frames, height, width, fps, codec): landscape, portrait and square; 24, 25 and 29.97 fps; odd sizes
SPECS = [(40, 48, 80, 24, "libx264"), (33, 80, 48, 25, "mpeg4"), (50, 64, 64, 30000 / 1001, "libx264"),
         (41, 50, 86, 24, "libx264"), (30, 84, 52, 25, "mpeg4"), (45, 60, 60, 24, "mpeg4")]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("clips")
    entries = []
    for i, (frames, height, width, fps, codec) in enumerate(SPECS):
        write_video(str(root / f"v{i}.mp4"), frames, height, width, fps, codec, gop=8)
        entries.append({"path": f"v{i}.mp4", "cap": [CAPTIONS[i], CAPTIONS[i] + " again"]})
    (root / "data.json").write_text(json.dumps(entries))
    tokenizer = bpe_tokenizer(str(root / "tokenizer"), CAPTIONS)
    return root, tokenizer


def make_dataset(root, tokenizer=None, **kwargs):
    options = dict(frames=FrameBuckets(num_frames=9, min_frames=5), buckets=AspectBuckets(max_area=32 * 48, stride=16),
                   fps=12, tokenizer=tokenizer, max_text_length=12)
    options.update(kwargs)
    return VideoTextDataset.from_annotations(str(root / "data.json"), **options)


def test_samples_equal_the_reference_preprocessing(data):
    root, tokenizer = data
    dataset = make_dataset(root, tokenizer, random_crop=False)
    assert len(dataset) == len(SPECS)
    for index in range(len(dataset)):
        sample = dataset.get(index)
        frames, height, width = dataset.keys[index]
        assert sample["video"].shape == (3, frames, height, width) and sample["video"].dtype == np.float32
        # independent path: decode every frame at the cover size, take frames at 12 fps, centre crop
        info = dataset.infos[index]
        size = cover_size(info.height, info.width, (height, width))
        full = decode_all(dataset.records[index].path, size)
        step = info.fps / 12
        span = int(np.floor((frames - 1) * step + 1e-9)) + 1
        picks = (len(full) - span) // 2 + np.floor(np.arange(frames) * step + 1e-9).astype(int)
        top, left = (size[0] - height) // 2, (size[1] - width) // 2
        want = full[picks, top:top + height, left:left + width].transpose(3, 0, 1, 2).astype(np.float32) / 127.5 - 1
        np.testing.assert_allclose(sample["video"], want, rtol=0, atol=1e-6)
        tokens = tokenizer(sample["caption"], padding="max_length", truncation=True, max_length=12)
        assert sample["input_ids"].tolist() == tokens["input_ids"]
        assert sample["caption"] in dataset.records[index].captions
    shapes = {k[1:] for k in dataset.keys}  # landscape, portrait and square buckets
    assert any(h < w for h, w in shapes) and any(h > w for h, w in shapes) and any(h == w for h, w in shapes)


def test_random_choices_depend_on_seed_epoch_and_index_only(data):
    root, _ = data
    dataset = make_dataset(root, caption_dropout=0.5)
    again = make_dataset(root, caption_dropout=0.5)
    a, b = dataset.get(3, epoch=1), again.get(3, epoch=1)
    assert np.array_equal(a["video"], b["video"]) and a["caption"] == b["caption"]
    variants = {dataset.get(3, epoch=e)["video"].tobytes() for e in range(6)}
    assert len(variants) > 1  # clip start and crop change with the epoch
    captions = [dataset.get(i, epoch=e)["caption"] for i in range(len(dataset)) for e in range(8)]
    assert 0.2 < captions.count("") / len(captions) < 0.8  # caption dropout for classifier-free guidance


def test_sampler_batches_do_not_depend_on_the_data_parallel_size():
    keys = [i % 3 for i in range(50)]
    one = BucketBatchSampler(50, 8, keys=keys, seed=5)
    shares = [BucketBatchSampler(50, 8, dp_rank=r, dp_size=4, keys=keys, seed=5) for r in range(4)]
    for epoch in range(3):
        batches = one.epoch_batches(epoch)
        assert len(batches) == sum(len([i for i in keys if i == k]) // 8 for k in range(3))
        for batch in batches:
            assert len({keys[i] for i in batch}) == 1 and len(set(batch.tolist())) == 8
            assert np.concatenate([s.local(batch) for s in shares]).tolist() == batch.tolist()
    assert [b.tolist() for b in one.epoch_batches(0)] != [b.tolist() for b in one.epoch_batches(1)]
    assert [b.tolist() for b in BucketBatchSampler(50, 8, keys=keys, seed=5).epoch_batches(1)] == \
        [b.tolist() for b in one.epoch_batches(1)]
    per_epoch = len(one.epoch_batches(0))
    assert one.state_at(per_epoch + 1) == {"epoch": 1, "position": 1, "seed": 5, "global_batch_size": 8}
    short = BucketBatchSampler(10, 4, keys=[0] * 10, drop_last=False)
    assert sorted(len(b) for b in short.epoch_batches(0)) == [2, 4, 4]
    assert length_groups([1, 256, 257, 600], 256) == [1, 1, 2, 3]
    with pytest.raises(ValueError, match="drop_last=True"):
        BucketBatchSampler(50, 8, dp_size=2, drop_last=False)
    with pytest.raises(ValueError, match="multiple of the data-parallel size"):
        BucketBatchSampler(50, 6, dp_size=4)
    with pytest.raises(DataError, match="no global batch"):
        BucketBatchSampler(5, 8)


def _take(loader, count):
    out, iterator = [], iter(loader)
    for _ in range(count):
        out.append(next(iterator))
    iterator.close()
    return out


def test_loader_workers_resume_and_layouts(data):
    root, tokenizer = data
    dataset = make_dataset(root, tokenizer)
    sampler = BucketBatchSampler(len(dataset), 2, keys=dataset.keys, seed=1)
    straight = _take(DataLoader(dataset, sampler), 7)  # 3 batches an epoch: crosses two epoch boundaries
    with_workers = DataLoader(dataset, sampler, num_workers=2, prefetch=2)
    assert all(np.array_equal(a["video"], b["video"]) and a["caption"] == b["caption"]
               for a, b in zip(straight, _take(with_workers, 7)))
    first = DataLoader(dataset, sampler)
    _take(first, 4)
    state = json.loads(json.dumps(first.state_dict()))  # a checkpoint holds it as JSON
    resumed = DataLoader(dataset, sampler)
    resumed.load_state_dict(state)
    assert all(np.array_equal(a["video"], b["video"]) for a, b in zip(straight[4:], _take(resumed, 3)))
    # resumed under data parallelism 2: each rank's share is its half of the same global batches
    halves = [DataLoader(dataset, BucketBatchSampler(len(dataset), 2, dp_rank=r, dp_size=2, keys=dataset.keys,
                                                     seed=1)) for r in range(2)]
    for half in halves:
        half.load_state_dict(state)
    for want, got0, got1 in zip(straight[4:], _take(halves[0], 3), _take(halves[1], 3)):
        assert np.array_equal(np.concatenate([got0["video"], got1["video"]]), want["video"])
    with pytest.raises(ValueError, match="global_batch_size"):
        DataLoader(dataset, BucketBatchSampler(len(dataset), 1, keys=dataset.keys, seed=1)).load_state_dict(state)


def test_collator_pads_ragged_fields():
    batch = Collator()([{"input_ids": np.array([1, 2, 3]), "labels": np.array([5, 6, 7]), "caption": "a"},
                        {"input_ids": np.array([4]), "labels": np.array([8]), "caption": "b"}])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7], [8, -100, -100]]
    assert batch["caption"] == ["a", "b"]
    padded = Collator(pad_to_multiple_of=4)([{"input_ids": np.array([1, 2, 3]), "labels": np.array([5, 6, 7])}])
    assert padded["input_ids"].tolist() == [[1, 2, 3, 0]] and padded["labels"].tolist() == [[5, 6, 7, -100]]


def test_bad_videos_are_replaced_counted_and_limited(data, tmp_path):
    root, _ = data
    entries = json.loads((root / "data.json").read_text())
    truncate(str(root / "v0.mp4"), str(tmp_path / "cut.mp4"), 0.5)  # header intact (mp4 moov at the end? no: cut)
    (tmp_path / "garbage.mp4").write_bytes(os.urandom(3000))
    for i in range(len(SPECS)):
        os.link(root / f"v{i}.mp4", tmp_path / f"v{i}.mp4")
    bad_entries = entries + [{"path": "cut.mp4", "cap": "cut", "num_frames": 40, "fps": 24,
                              "resolution": {"height": 48, "width": 80}},
                             {"path": "garbage.mp4", "cap": "noise"}, {"path": "gone.mp4", "cap": "missing"}]
    (tmp_path / "data.json").write_text(json.dumps(bad_entries))
    dataset = VideoTextDataset.from_annotations(str(tmp_path / "data.json"), max_bad_fraction=0.5,
                                                frames=FrameBuckets(num_frames=9, min_frames=5),
                                                buckets=AspectBuckets(max_area=32 * 48, stride=16), fps=12)
    assert len(dataset) == 7 and dataset.bad_input.count == 2  # garbage and missing known before training
    with pytest.raises(BadSample):
        dataset.get(6)  # the cut file: its header claims 40 frames
    sampler = BucketBatchSampler(len(dataset), 1, keys=dataset.keys, seed=0)
    batches = _take(DataLoader(dataset, sampler, num_workers=1), 7)
    assert dataset.bad_input.count == 3 and any("cut.mp4" in s for s, _ in dataset.bad_input.skipped)
    assert all(b["video"].shape[0] == 1 for b in batches)  # the bad one was replaced, the batch kept its size
    strict = VideoTextDataset.from_annotations(str(tmp_path / "data.json"), max_bad_fraction=0.3,
                                               frames=FrameBuckets(num_frames=9, min_frames=5),
                                               buckets=AspectBuckets(max_area=32 * 48, stride=16), fps=12)
    with pytest.raises(DataError, match="cut.mp4") as error:
        _take(DataLoader(strict, BucketBatchSampler(len(strict), 1, keys=strict.keys, seed=0)), 7)
    assert "gone.mp4" in str(error.value) and "garbage.mp4" in str(error.value)


class _Dies:
    """A data set whose worker exits hard on sample 3, or sleeps on sample 2."""

    bad_input = None

    def __init__(self, mode):
        self.mode = mode

    def __len__(self):
        return 8

    def __getitem__(self, index):
        if self.mode == "die" and index == 3:
            os._exit(7)
        if self.mode == "sleep" and index == 2:
            time.sleep(60)
        return {"x": np.full(2, index)}


def test_loader_never_hangs_on_a_dead_or_stuck_worker():
    sampler = BucketBatchSampler(8, 1, shuffle=False)
    with pytest.raises(DataError, match=r"worker 1 \(pid \d+\) died with exit code 7"):
        _take(DataLoader(_Dies("die"), sampler, num_workers=2), 8)
    start = time.monotonic()
    with pytest.raises(DataError, match="timeout=3"):
        _take(DataLoader(_Dies("sleep"), sampler, num_workers=2, timeout=3), 8)
    assert time.monotonic() - start < 30


def test_feature_cache_round_trip_and_resume(data, tmp_path):
    root, tokenizer = data
    dataset = make_dataset(root, tokenizer, random_crop=False)
    table = np.random.default_rng(0).standard_normal((tokenizer.vocab_size, 4)).astype(np.float32)
    encoders = {"latents": lambda batch: batch["video"][:, :, ::4, ::8, ::8] * 0.5,  # stand-ins for VAE / T5
                "prompt_embeds": lambda batch: table[batch["input_ids"]]}
    folder = str(tmp_path / "cache")
    written = [build_feature_cache(dataset, encoders, folder, batch_size=2, samples_per_shard=2, rank=r, world_size=2)
               for r in range(2)]
    assert sum(written) == len(dataset)
    assert build_feature_cache(dataset, encoders, folder, rank=0, world_size=2) == 0  # already cached
    features = FeatureDataset(folder)
    assert len(features) == len(dataset)
    for i in range(len(dataset)):
        sample, cached = dataset.get(i), features.get(i)
        batch = Collator()([sample])
        np.testing.assert_array_equal(cached["latents"], encoders["latents"](batch)[0])
        np.testing.assert_array_equal(cached["prompt_embeds"], encoders["prompt_embeds"](batch)[0])
        assert cached["caption"] == sample["caption"] and int(cached["index"]) == i
    # an interrupted build (rank 1's index lost) is finished by a rerun
    os.remove(os.path.join(folder, "index-r001.jsonl"))
    assert build_feature_cache(dataset, encoders, folder, rank=1, world_size=2) == written[1]
    again = FeatureDataset(folder)
    loader = DataLoader(again, BucketBatchSampler(len(again), 2, keys=again.keys, seed=0, drop_last=False),
                        num_workers=1)
    batch = _take(loader, 1)[0]
    assert batch["latents"].shape[0] in (1, 2) and batch["prompt_embeds"].shape[1:] == (12, 4)
