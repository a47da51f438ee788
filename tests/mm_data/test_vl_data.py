"""LLaMA-Factory conversations, the Qwen chat template, the video processor, VL samples and packing."""

import json
import os

import numpy as np
import pytest
from helpers.media import QWEN_SPECIAL, qwen_tokenizer, write_image, write_video

from mm_data.errors import BadInputLog, BadSample
from mm_data.loader import DataLoader
from mm_data.sampler import BucketBatchSampler
from mm_data.vl import (
    IGNORE_INDEX,
    PackedDataset,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
    QwenChatTemplate,
    VLSFTDataset,
    parse_entry,
    plan_packs,
    read_conversations,
)

TEXTS = ["What is in the picture?", "A cat on a mat.", "Describe the video.", "A bar moves down.",
         "system user assistant", "You are a helpful assistant.", "And the second one?", "Two dogs."]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return qwen_tokenizer(str(tmp_path_factory.mktemp("tok")), TEXTS)


def test_both_llamafactory_layouts_parse_to_the_same_conversation(tmp_path):
    messages = {"messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "<image>What is it?"},
                             {"role": "assistant", "content": "A cat."}], "images": ["a.png"]}
    sharegpt = {"conversations": [{"from": "human", "value": "<image>What is it?"}, {"from": "gpt", "value": "A cat."}],
                "system": "Be brief.", "images": ["a.png"]}
    a, b = parse_entry(messages, "m", "/data"), parse_entry(sharegpt, "s", "/data")
    assert a.turns == b.turns == (("user", "<image>What is it?"), ("assistant", "A cat."))
    assert a.system == b.system == "Be brief." and a.images == b.images == ("/data/a.png",)
    for bad, reason in [({"messages": [{"role": "user", "content": "<image><image>x"},
                                       {"role": "assistant", "content": "y"}],
                          "images": ["a.png"]}, "2 <image> placeholders but 1 images"),
                        ({"messages": [{"role": "user", "content": "x"}]}, "end with the assistant"),
                        ({"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]},
                         "alternate"),
                        ({"conversations": [{"from": "robot", "value": "x"}]}, "role 'robot'"),
                        ({"text": "x"}, "no 'messages'"),
                        ({"messages": "not a list"}, "'messages' must be a list of messages, got str"),
                        ({"conversations": []}, "'conversations' is an empty list"),
                        ({"messages": [{"role": "user", "content": "x<video>"}, {"role": "assistant", "content": "y"}]},
                         "1 <video> placeholders but 0 videos")]:
        with pytest.raises(BadSample, match=reason):
            parse_entry(bad, "entry")
    lines = [json.dumps(messages), "{not json", json.dumps({"text": "x"}), json.dumps(sharegpt)]
    (tmp_path / "data.jsonl").write_text("\n".join(lines))
    log = BadInputLog(max_bad_fraction=0.5)
    conversations = read_conversations(str(tmp_path / "data.jsonl"), log=log)
    assert len(conversations) == 2 and log.count == 2 and log.total == 4
    assert conversations[0].images == (str(tmp_path / "a.png"),)


def test_chat_template_text_labels_and_token_types(tokenizer):
    template = QwenChatTemplate(tokenizer)
    conversation = parse_entry({"messages": [{"role": "user", "content": "<image>What is in the picture?"},
                                             {"role": "assistant", "content": "A cat on a mat."},
                                             {"role": "user", "content": "And the second one?<video>"},
                                             {"role": "assistant", "content": "Two dogs."}],
                                "images": ["a.png"], "videos": ["b.mp4"]}, "c")
    out = template.encode(conversation, image_tokens=[3], video_tokens=[2])
    want = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            "<|im_start|>user\n<|vision_start|><|image_pad|><|image_pad|><|image_pad|><|vision_end|>"
            "What is in the picture?<|im_end|>\n<|im_start|>assistant\nA cat on a mat.<|im_end|>\n"
            "<|im_start|>user\nAnd the second one?<|vision_start|><|video_pad|><|video_pad|><|vision_end|><|im_end|>\n"
            "<|im_start|>assistant\nTwo dogs.<|im_end|>\n")
    assert tokenizer.decode(out["input_ids"]) == want
    assert out["input_ids"].tolist() == tokenizer(want, add_special_tokens=False)["input_ids"]  # pieces == whole
    trained = out["labels"] != IGNORE_INDEX
    assert np.array_equal(out["labels"][trained], out["input_ids"][trained])
    spans = np.split(out["labels"], np.flatnonzero(np.diff(trained.astype(int))) + 1)
    assert [tokenizer.decode(s) for s in spans if s[0] != IGNORE_INDEX] == ["A cat on a mat.<|im_end|>\n",
                                                                           "Two dogs.<|im_end|>\n"]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    assert np.array_equal(out["mm_token_type_ids"], np.select([out["input_ids"] == ids["<|image_pad|>"],
                                                                out["input_ids"] == ids["<|video_pad|>"]], [1, 2], 0))
    with pytest.raises(BadSample, match="split its media"):
        template.encode(conversation, [3], [2], max_length=20)
    assert len(template.encode(conversation, [3], [2], max_length=len(out["input_ids"]) - 3)["input_ids"]) == \
        len(out["input_ids"]) - 3


def _hf_messages(conversation):
    """A parsed conversation as transformers' chat messages (media as content items)."""
    import re

    def content(text):
        pieces = [p for p in re.split(r"(<image>|<video>)", text) if p]
        return [{"type": p[1:-1]} if p in ("<image>", "<video>") else {"type": "text", "text": p} for p in pieces]

    system = [] if conversation.system is None else [{"role": "system", "content": conversation.system}]
    return system + [{"role": role, "content": content(text)} for role, text in conversation.turns]


@pytest.mark.parametrize("default_system", ["You are a helpful assistant.", None])
def test_chat_template_as_jinja_renders_what_encode_trains_on(tokenizer, default_system):
    """transformers' apply_chat_template with `jinja()`, each pad expanded to the media's count (what
    its Qwen processors do), tokenises to `encode`'s ids: one image, a video, two turns, an own system."""
    template = QwenChatTemplate(tokenizer, default_system)
    tokenizer.chat_template = template.jinja()
    entries = [{"messages": [{"role": "user", "content": "<image>What is in the picture?"},
                             {"role": "assistant", "content": "A cat on a mat."},
                             {"role": "user", "content": "And the second one?<video>"},
                             {"role": "assistant", "content": "Two dogs."}], "images": ["a.png"], "videos": ["b.mp4"]},
               {"messages": [{"role": "system", "content": "system user"},
                             {"role": "user", "content": "Describe the video.<video>"},
                             {"role": "assistant", "content": "A bar moves down."}], "videos": ["b.mp4"]},
               {"messages": [{"role": "user", "content": "What is in the picture?"},
                             {"role": "assistant", "content": "Two dogs."}]}]
    for entry in entries:
        conversation = parse_entry(entry, "c")
        counts = {"<|image_pad|>": [3] * len(conversation.images), "<|video_pad|>": [2, 4][:len(conversation.videos)]}
        want = template.encode(conversation, counts["<|image_pad|>"], counts["<|video_pad|>"])["input_ids"].tolist()
        text = rendered = tokenizer.apply_chat_template(_hf_messages(conversation), tokenize=False)
        for pad, sizes in counts.items():
            pieces = text.split(pad)
            text = pieces[0] + "".join(pad * n + rest for n, rest in zip(sizes, pieces[1:]))
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == want, text
        prompt = tokenizer.apply_chat_template(_hf_messages(conversation)[:-1], tokenize=False,
                                               add_generation_prompt=True)
        assert rendered.startswith(prompt) and prompt.endswith("<|im_start|>assistant\n")


def test_processor_settings_round_trip_through_transformers_names(tmp_path):
    """`to_dict` is a preprocessor_config.json transformers' image processor loads with the same
    settings (same pixels out), and each processor class builds itself again from it."""
    from transformers import AutoImageProcessor

    from mm_data.vl import Qwen3VLVideoProcessor

    image = Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=64 * 28 * 28, patch_size=14)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {**image.to_dict(), "image_processor_type": "Qwen2VLImageProcessor"}))
    loaded = AutoImageProcessor.from_pretrained(tmp_path)
    picture = np.random.default_rng(1).integers(0, 256, (97, 41, 3), dtype=np.uint8)
    want = image(picture)
    got = loaded([picture], return_tensors="np")
    assert np.array_equal(got["image_grid_thw"], want["image_grid_thw"])
    assert np.array_equal(got["pixel_values"], want["pixel_values"])
    assert Qwen2VLImageProcessor(**image.to_dict()).to_dict() == image.to_dict()
    for video in (Qwen2VLVideoProcessor(max_pixels=32 * 28 * 28, fps=2.0),
                  Qwen3VLVideoProcessor(min_pixels=32 * 32, fps=1.0, cap_pixels_per_frame=True)):
        again = type(video)(**json.loads(json.dumps(video.to_dict())))
        assert again.to_dict() == video.to_dict() and again.fps == video.fps and again.size == video.size


def test_video_processor_frames_match_transformers_image_processor():
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    rng = np.random.default_rng(0)
    options = {"min_pixels": 28 * 28, "max_pixels": 64 * 28 * 28}
    ours, images = Qwen2VLVideoProcessor(**options), Qwen2VLImageProcessorPil(**options)
    for height, width in [(60, 90), (97, 41), (224, 224), (33, 300)]:
        frames = rng.integers(0, 256, (3, height, width, 3), dtype=np.uint8)
        got = ours(videos=[frames])
        per_frame = [images([Image.fromarray(f)], return_tensors="np") for f in frames]
        grid_h, grid_w = per_frame[0]["image_grid_thw"][0][1:]
        assert got["video_grid_thw"].tolist() == [[2, grid_h, grid_w]]  # 3 frames padded to 4
        patches = got["pixel_values_videos"].reshape(2, grid_h * grid_w, 3, 2, 14, 14)
        for t in range(4):  # temporal slot t % 2 of patch t // 2 is frame t (the last one repeated)
            want = per_frame[min(t, 2)]["pixel_values"].reshape(grid_h * grid_w, 3, 2, 14, 14)[:, :, 0]
            assert np.array_equal(patches[t // 2, :, :, t % 2], want), (height, width, t)
    threaded = Qwen2VLVideoProcessor(**options, num_threads=2)(videos=[frames, frames[:2]])
    assert np.array_equal(threaded["pixel_values_videos"][:len(got["pixel_values_videos"])], got["pixel_values_videos"])
    still = rng.integers(0, 256, (50, 70, 3), dtype=np.uint8)  # two equal frames == the image, bit for bit
    assert np.array_equal(ours(videos=[np.stack([still, still])])["pixel_values_videos"],
                          images([Image.fromarray(still)], return_tensors="np")["pixel_values"])


def test_video_frame_sampling():
    import torch

    processor = Qwen2VLVideoProcessor(min_frames=4, max_frames=16)
    for total in (5, 17, 30, 61, 100, 301):
        for num_frames in (2, 4, 6, 10):
            if num_frames <= total:
                want = torch.arange(0, total, total / num_frames).int().numpy()  # transformers' expression
                assert processor.sample_frames(total, 30.0, num_frames=num_frames).tolist() == want.tolist()
    # fps rule: total / video_fps * fps frames, within [min_frames, max_frames] and the video, floored to pairs
    assert len(processor.sample_frames(300, 30.0, fps=1.0)) == 10
    assert len(processor.sample_frames(300, 30.0, fps=0.1)) == 4      # min_frames
    assert len(processor.sample_frames(300, 30.0, fps=10.0)) == 16    # max_frames
    assert len(processor.sample_frames(9, 30.0, fps=2.0)) == 4
    assert len(processor.sample_frames(7, 30.0, fps=30.0)) == 6       # the video's own frames, floored to pairs
    with pytest.raises(ValueError, match="mutually exclusive"):
        processor.sample_frames(30, 30.0, num_frames=4, fps=2.0)


@pytest.fixture(scope="module")
def vl_set(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("vl")
    write_image(str(root / "a.png"), 60, 90, 0)
    write_image(str(root / "b.jpg"), 97, 41, 1)
    write_image(str(root / "c.png"), 56, 56, 2, mode="L")
    write_image(str(root / "sliver.png"), 2, 500, 3)  # aspect 250: transformers refuses beyond 200
    write_video(str(root / "v.mp4"), 24, 56, 84, 12, "libx264")
    (root / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(100))
    user = lambda text, n=1: {"role": "user", "content": text}  # noqa: E731
    reply = lambda text: {"role": "assistant", "content": text}  # noqa: E731
    entries = [{"messages": [user("<image>What is in the picture?"), reply("A cat on a mat.")], "images": ["a.png"]},
               {"messages": [user("Describe the video.<video>"), reply("A bar moves down.")], "videos": ["v.mp4"]},
               {"messages": [user("<image><image>And the second one?"), reply("Two dogs.")],
                "images": ["b.jpg", "c.png"]},
               {"conversations": [{"from": "human", "value": "What is in the picture?"},
                                  {"from": "gpt", "value": "A cat."}]},
               {"messages": [user("<image>x"), reply("y")], "images": ["broken.png"]},
               {"messages": [user("<video>x"), reply("y")], "videos": ["missing.mp4"]},
               {"messages": [user("<image>x"), reply("y")], "images": ["sliver.png"]}]
    (root / "data.json").write_text(json.dumps(entries))
    return VLSFTDataset.from_file(str(root / "data.json"), tokenizer, max_bad_fraction=0.5,
                                  image_processor=Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=64 * 28 * 28),
                                  video_processor=Qwen2VLVideoProcessor(min_pixels=28 * 28, max_pixels=16 * 28 * 28),
                                  video_fps=4.0)


def test_vl_samples_feed_transformers_qwen2_5_vl(vl_set, tokenizer):
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    samples = [vl_set.get(i) for i in range(4)]
    for index, sample in enumerate(samples):
        assert len(sample["input_ids"]) == vl_set.length(index)  # lengths from headers equal the real ones
    video = samples[1]
    assert video["video_grid_thw"].tolist() == [[4, 4, 6]]  # 24 frames at 12 fps -> 8 at 4 fps; 56 x 84 px
    np.testing.assert_allclose(video["second_per_grid_ts"], [0.5])  # 2 frames per patch at 4 fps
    for bad in (4, 5, 6):
        with pytest.raises(BadSample):
            vl_set.get(bad)
    batch = vl_set.collator()(samples)
    assert batch["input_ids"].shape[0] == 4 and batch["image_grid_thw"].shape == (3, 3)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=len(tokenizer), rope_parameters={
                             "rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                           window_size=56, fullatt_block_indexes=[0]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # the reference checks that placeholders match the media features
        out = model(**{k: torch.from_numpy(v) for k, v in batch.items()})
    assert torch.isfinite(out.loss) and out.logits.shape[:2] == batch["input_ids"].shape


def test_vl_loader_skips_bad_samples(vl_set):
    loader = DataLoader(vl_set, BucketBatchSampler(len(vl_set), 2, seed=0), collate=vl_set.collator())
    iterator = iter(loader)
    batches = [next(iterator) for _ in range(6)]
    iterator.close()
    assert all(b["input_ids"].shape[0] == 2 for b in batches)
    assert {os.path.basename(s) for s, _ in vl_set.bad_input.skipped} >= {"broken.png", "missing.mp4"}


def test_packing_counts_a_sample_longer_than_a_pack(caplog):
    """A sample longer than max_length is a counted, logged skip naming what to change, never a silent drop."""
    import logging

    from mm_data.errors import BadInputLog, DataError

    class Lengths:
        def __init__(self, lengths):
            self.lengths, self.bad_input = lengths, BadInputLog(0.25, total=len(lengths))

        def __len__(self):
            return len(self.lengths)

        def source(self, index):
            return f"row{index}.json"

        def length(self, index):
            return self.lengths[index]

    with caplog.at_level(logging.WARNING, logger="mm_data"):
        packed = PackedDataset(Lengths([10, 50, 30, 5]), max_length=40)
    assert sorted(i for p in packed.packs for i in p) == [0, 2, 3] and packed.bad_input.count == 1
    assert "row1.json: 50 tokens, more than the packs' max_length=40: raise it" in caplog.text
    with pytest.raises(DataError, match="2 of 4 samples are bad"):
        PackedDataset(Lengths([10, 50, 60, 5]), max_length=40)


def test_packing(vl_set):
    rng = np.random.default_rng(0)
    for _ in range(50):
        lengths = rng.integers(1, 40, int(rng.integers(1, 30))).tolist()
        packs = plan_packs(lengths, 40)
        assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in p) <= 40 for p in packs)
        assert len(packs) <= 2 * -(-sum(lengths) // 40)  # first-fit: never worse than twice the optimum
    packed = PackedDataset(vl_set, max_length=160)
    assert sorted(i for p in packed.packs for i in p) == [0, 1, 2, 3]  # the bad ones planned nowhere
    assert {os.path.basename(s) for s, _ in vl_set.bad_input.skipped} == {"broken.png", "missing.mp4", "sliver.png"}
    for number in range(len(packed)):
        row, members = packed.get(number), packed.packs[number]
        parts = [vl_set.get(i) for i in members]
        assert np.array_equal(row["input_ids"], np.concatenate([p["input_ids"] for p in parts]))
        sizes = [len(p["input_ids"]) for p in parts]
        assert row["attention_mask"].tolist() == sum(([k + 1] * n for k, n in enumerate(sizes)), [])
        assert "position_ids" not in row  # the models compute each sample's own (M-RoPE needs its media)
        if any("pixel_values" in p for p in parts):
            assert np.array_equal(row["pixel_values"],
                                  np.concatenate([p["pixel_values"] for p in parts if "pixel_values" in p]))


def test_rows_under_a_token_budget_fill_it_inside_windows():
    """plan_rows on a long-tailed stream (lognormal tokens around 563, at most 4096, as MindSpeed-
    MM's Qwen2.5-VL data): rows under 4096 tokens with under 5 % padding, each row from one window,
    every sample exactly once, a sample over the budget alone in its row and reported."""
    from mm_data.vl.packing import plan_rows

    rng = np.random.default_rng(0)
    lengths = [int(n) for n in np.minimum(rng.lognormal(np.log(450), 0.7, 1000), 4096).round()] + [5000, 7]
    rows, oversized = plan_rows(lengths, 4096, window=128)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert oversized == [1000] and [1000] in rows
    fitted = [row for row in rows if row != [1000]]
    assert all(sum(lengths[i] for i in row) <= 4096 for row in fitted)
    assert all(len({i // 128 for i in row}) == 1 for row in rows)
    padding = 1 - sum(lengths[i] for row in fitted for i in row) / (4096 * len(fitted))
    assert padding < 0.05, padding
    assert plan_rows(lengths, 4096) == (rows, oversized)
    with pytest.raises(ValueError, match="must be >= 1"):
        plan_rows(lengths, 0)


def test_packed_rows_cut_a_share_into_rows_under_the_budget(vl_set, caplog):
    """PackedRows: every good sample of the share exactly once, in rows of at most max_tokens
    (a longer sample alone, counted and logged), each row collated to the layout's multiple with
    padding numbered 0 and labels -100, its media joined in order."""
    import logging

    from mm_data.vl import PackedRows

    samples = [vl_set.get(i) for i in range(4)]
    lengths = [len(s["input_ids"]) for s in samples]
    budget = sorted(lengths)[-2]  # the longest sample is over it
    rows = PackedRows(vl_set.collator(8), budget)
    with caplog.at_level(logging.WARNING, logger="mm_data"):
        batches = rows(samples)
    assert rows.oversized == 1 and f"longer than data.max_tokens={budget}" in caplog.text
    seen = []
    for batch in batches:
        mask = batch["attention_mask"][0]
        assert batch["input_ids"].shape[0] == 1 and mask.size % 8 == 0
        real = int((mask != 0).sum())
        assert real <= budget or real == max(lengths)
        assert np.all(batch["labels"][0][mask == 0] == -100) and np.all(mask[real:] == 0)
        for number in range(1, int(mask.max()) + 1):  # each numbered run is one whole sample
            tokens = batch["input_ids"][0][mask == number]
            seen += [k for k, s in enumerate(samples) if np.array_equal(tokens, s["input_ids"]) and k not in seen][:1]
    assert sorted(seen) == [0, 1, 2, 3]
