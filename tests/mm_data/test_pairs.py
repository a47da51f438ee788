"""Preference pairs as samples (mm_data.vl.pairs): both answers of a prompt in one sample, its
media processed once, the rejected half of a micro-batch repeating the chosen half's media runs,
padded rows and packed rows alike; bad pairs counted, pair data refused for SFT."""

import json

import numpy as np
import pytest
from helpers.media import qwen_tokenizer, write_image

from mm_data.errors import BadInputLog, BadSample
from mm_data.vl import PairCollate, PairedRows, VLSFTDataset
from mm_data.vl.pairs import unfold

TEXTS = ["What colour is it?", "Red.", "Blue, with a long story about the sea.", "Hello", "Hi.", "Go away."]


@pytest.fixture(scope="module")
def pair_set(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pairs")
    write_image(str(folder / "red.png"), 56, 84)
    entries = [{"messages": [{"role": "user", "content": "<image>What colour is it?"}], "images": ["red.png"],
                "chosen": {"role": "assistant", "content": "Red."},
                "rejected": {"role": "assistant", "content": "Blue, with a long story about the sea."}},
               {"conversations": [{"from": "human", "value": "Hello"}], "chosen": "Hi.", "rejected": "Go away."}]
    (folder / "pairs.json").write_text(json.dumps(entries))
    return folder, qwen_tokenizer(str(folder / "tok"), TEXTS)


def _dataset(folder, tokenizer, **options):
    return VLSFTDataset.from_file(str(folder / "pairs.json"), tokenizer, max_bad_fraction=0.9, **options)


def test_a_pair_sample_holds_both_sequences_and_its_media_once(pair_set):
    folder, tokenizer = pair_set
    data = _dataset(folder, tokenizer, pairs=True)
    sample = data.get(0)
    chosen, rejected = sample["input_ids"], sample["rejected_input_ids"]
    answer = lambda ids, labels: tokenizer.decode(ids[labels != -100])  # noqa: E731
    assert answer(chosen, sample["labels"]) == "Red.<|im_end|>\n"
    assert answer(rejected, sample["rejected_labels"]) == "Blue, with a long story about the sea.<|im_end|>\n"
    prompt = int(np.argmax(sample["labels"] != -100))
    assert (chosen[:prompt] == rejected[:prompt]).all()  # one prompt, its image pads included
    assert len(sample["image_grid_thw"]) == 1 and data.length(0) == len(chosen) + len(rejected)

    pairs = [data.get(0), data.get(1)]
    batch = PairCollate(data.collator())(pairs)
    assert batch["input_ids"].shape[0] == 4 and batch["media_copies"] == 2
    assert (batch["input_ids"][0, :len(chosen)] == chosen).all()
    assert (batch["input_ids"][2, :len(rejected)] == rejected).all()  # rows [chosen 0, chosen 1, rejected 0, ...]
    assert batch["pixel_values"].shape == sample["pixel_values"].shape  # the pixels once
    assert batch["image_grid_thw"].tolist() == sample["image_grid_thw"].tolist() * 2  # a grid per placeholder run
    assert batch["answer_tokens"].tolist() == [int((s["labels"] != -100).sum()) for s in unfold(pairs)]

    rows = PairedRows(data.collator(), max_tokens=10_000)(pairs)
    assert len(rows) == 1 and rows[0]["attention_mask"].max() == 4 and rows[0]["media_copies"] == 2
    segments = rows[0]["attention_mask"][0]
    assert (rows[0]["input_ids"][0][segments == 3] == rejected).all()  # the chosen segments first
    assert rows[0]["image_grid_thw"].tolist() == batch["image_grid_thw"].tolist()
    assert rows[0]["answer_tokens"].tolist() == batch["answer_tokens"].tolist()


def test_pairs_are_never_cut_and_sft_refuses_pair_data(pair_set):
    folder, tokenizer = pair_set
    long_side = len(_dataset(folder, tokenizer, pairs=True).get(0)["rejected_input_ids"])
    data = _dataset(folder, tokenizer, pairs=True, max_length=long_side - 1)
    with pytest.raises(BadSample, match="the rejected sequence has .* a pair is never cut"):
        data.get(0)
    with pytest.raises(ValueError, match="holds 2 preference pairs .* train.objective dpo"):
        _dataset(folder, tokenizer)
    (folder / "sft.json").write_text(json.dumps([{"conversations": [{"from": "human", "value": "Hello"},
                                                                    {"from": "gpt", "value": "Hi."}]}]))
    with pytest.raises(ValueError, match="needs pairs"):
        VLSFTDataset.from_file(str(folder / "sft.json"), tokenizer, pairs=True)
    mixed = VLSFTDataset([*_dataset(folder, tokenizer, pairs=True).conversations,
                          *VLSFTDataset.from_file(str(folder / "sft.json"), tokenizer).conversations],
                         tokenizer, pairs=True, bad_input=BadInputLog(0.9))
    with pytest.raises(BadSample, match="not a preference pair"):
        mixed.get(2)


def test_clip_pairs_are_cached_together_and_bad_pairs_are_counted(tmp_path):
    """Clip pairs (mm_data.video.pairs): both clips of each good pair in the feature cache, served
    as one sample (the rejected clip's features under rejected_*, the prompt's once); a missing
    side, a missing file, one clip on both sides and a pair whose clips fall into other buckets
    are skipped and counted."""
    from helpers.media import write_video

    from mm_data import FeaturePairs, build_feature_cache
    from mm_data.video import AspectBuckets, FrameBuckets, VideoTextDataset
    from mm_data.video.pairs import write_pair_list

    for name, (height, width) in {"a": (32, 32), "b": (32, 32), "c": (32, 32), "wide": (32, 96)}.items():
        write_video(str(tmp_path / f"{name}.mp4"), frames=9, height=height, width=width, fps=8)
    entries = [{"prompt": "a square", "chosen": "a.mp4", "rejected": "b.mp4"},
               {"prompt": "a circle", "chosen": "c.mp4", "rejected": "wide.mp4"},  # another aspect bucket
               {"prompt": "no side", "chosen": "a.mp4"},
               {"prompt": "gone", "chosen": "a.mp4", "rejected": "missing.mp4"},
               {"cap": "same", "chosen": "a.mp4", "rejected": "a.mp4"}]
    (tmp_path / "clip_pairs.json").write_text(json.dumps(entries))
    clips = VideoTextDataset.from_annotations(str(tmp_path / "clip_pairs.json"), max_bad_fraction=0.9, pairs=True,
                                              frames=FrameBuckets(num_frames=9), random_crop=False,
                                              buckets=AspectBuckets(max_area=32 * 96, stride=16), fps=8)
    assert len(clips.clip_pairs) == 2 and len(clips) == 4 and clips.bad_input.count == 3
    assert [r.captions for r in clips.records] == [("a square",)] * 2 + [("a circle",)] * 2
    reasons = " ".join(reason for _, reason in clips.bad_input.skipped)
    assert "'rejected' is missing" in reasons and "not there" in reasons and "the same file" in reasons

    encoders = {"latents": lambda b: b["video"][:, :, ::4, ::8, ::8].copy(),
                "prompt_embeds": lambda b: np.ones((len(b["video"]), 2, 3), np.float32)}
    cache = tmp_path / "cache"
    build_feature_cache(clips, encoders, str(cache))
    write_pair_list(str(cache), clips.clip_pairs)
    pairs = FeaturePairs(str(cache), max_bad_fraction=0.9)
    assert len(pairs) == 1 and pairs.bad_input.count == 1  # the pair across buckets
    assert "differ in shape" in pairs.bad_input.skipped[0][1]
    sample = pairs.get(0)
    assert set(sample) >= {"latents", "rejected_latents", "prompt_embeds", "index"}
    assert "rejected_prompt_embeds" not in sample
    features = pairs.features
    side = {features.source(i).rsplit("/", 1)[-1]: features.get(i) for i in range(len(features))}
    assert pairs.source(0).endswith("a.mp4") and int(sample["index"]) == int(side["a.mp4"]["index"])
    np.testing.assert_array_equal(sample["rejected_latents"], side["b.mp4"]["latents"])
    with pytest.raises(ValueError, match="not built from clip pairs"):
        FeaturePairs(str(tmp_path))  # a folder without the pair list
