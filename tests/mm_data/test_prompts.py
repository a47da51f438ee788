"""Prompts as samples (mm_data.vl.prompts, GRPO): an entry's turns to its last user turn with the
reference answer from ``solution`` or from the answer that ended the turns, the prompt encoded up
to the assistant's header as the SFT sample's prompt part is, never cut (a longer one counted as a
bad sample); a collated batch left-padded for decoding; G sequences per prompt collated
copy-major with the prompt's media once (mm_data.vl.groups)."""

import json

import numpy as np
import pytest
from helpers.media import qwen_tokenizer, write_image

from mm_data.errors import BadSample
from mm_data.vl import PROMPT_INDEX, VLSFTDataset, collate_groups, left_padded, parse_entry

TEXTS = ["What colour is it?", "Red.", "Hello", "Hi.", "How many?", "12"]
ENTRIES = [
    {"messages": [{"role": "user", "content": "<image>What colour is it?"}], "images": ["red.png"], "solution": "red"},
    {"conversations": [{"from": "human", "value": "How many?"}, {"from": "gpt", "value": "12"}]},
    {"messages": [{"role": "user", "content": "Hello"}], "solution": 12.5},
    {"messages": [{"role": "user", "content": "Hello " * 120}], "solution": "x"},
]


@pytest.fixture(scope="module")
def prompt_set(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prompts")
    write_image(str(folder / "red.png"), 56, 84)
    (folder / "prompts.json").write_text(json.dumps(ENTRIES))
    return folder, qwen_tokenizer(str(folder / "tok"), TEXTS)


def _dataset(folder, tokenizer, **options):
    return VLSFTDataset.from_file(str(folder / "prompts.json"), tokenizer, max_bad_fraction=0.9, prompts=True,
                                  **options)


def test_a_prompt_sample_is_the_sft_samples_prompt_with_its_reference_answer(prompt_set):
    folder, tokenizer = prompt_set
    data = _dataset(folder, tokenizer, max_length=100)
    assert [data.solution(i) for i in range(len(data))] == ["red", "12", "12.5", "x"]
    sample = data.get(0)
    assert "labels" not in sample and int(sample[PROMPT_INDEX]) == 0 and len(sample["image_grid_thw"]) == 1
    sft = VLSFTDataset.from_file(str(folder / "prompts.json"), tokenizer, max_bad_fraction=0.9)  # as SFT: refused
    assert len(sft) == 1  # only the entry whose turns end with an answer is an SFT sample
    whole = sft.get(0)
    prompt = int(np.argmax(whole["labels"] != -100))
    np.testing.assert_array_equal(data.get(1)["input_ids"], whole["input_ids"][:prompt])
    assert tokenizer.decode(sample["input_ids"]).endswith("<|im_start|>assistant\n")
    with pytest.raises(BadSample, match="never cut"):
        data.get(3)


@pytest.mark.parametrize("entry, message", [
    ({"messages": [{"role": "user", "content": "a"}], "solution": ["red"]}, "text or a number"),
    ({"messages": [{"role": "assistant", "content": "a"}]}, "end with the user"),
    ({"messages": [{"role": "user", "content": "a"}], "chosen": {"role": "assistant", "content": "b"},
      "rejected": {"role": "assistant", "content": "c"}}, "not a prompt"),
    ({"messages": [{"role": "user", "content": "<image>a"}], "solution": "b"}, "placeholders but 0 images"),
])
def test_bad_prompt_entries_say_why(entry, message):
    with pytest.raises(BadSample, match=message):
        parse_entry(entry, "data.json:0", prompts=True)


def test_left_padding_moves_each_rows_pads_to_its_front_and_keeps_the_media(prompt_set):
    folder, tokenizer = prompt_set
    data = _dataset(folder, tokenizer, max_length=100)
    batch = data.collator()([data.get(1), data.get(0)])
    left = left_padded(batch)
    for row in range(2):
        real = batch["attention_mask"][row] == 1
        np.testing.assert_array_equal(left["input_ids"][row, -real.sum():], batch["input_ids"][row, real])
        np.testing.assert_array_equal(left["mm_token_type_ids"][row, -real.sum():],
                                      batch["mm_token_type_ids"][row, real])
    assert (left["attention_mask"][:, -1] == 1).all() and (left["attention_mask"][0, 0] == 0)
    np.testing.assert_array_equal(left["pixel_values"], batch["pixel_values"])


def test_a_prompts_completions_are_collated_copy_major_with_its_media_once(prompt_set):
    folder, tokenizer = prompt_set
    data = _dataset(folder, tokenizer, max_length=100)
    prompts = [{k: v for k, v in data.get(i).items() if k != PROMPT_INDEX} for i in (0, 1)]
    groups = [[{**p, "input_ids": np.concatenate([p["input_ids"], [7 + c]]),
                "attention_mask": np.ones(len(p["input_ids"]) + 1, np.int64),
                "mm_token_type_ids": np.concatenate([p["mm_token_type_ids"], [0]])} for c in range(3)]
              for p in prompts]
    batch = collate_groups(data.collator(), groups)
    assert batch["input_ids"].shape[0] == 6 and batch["media_copies"] == 3
    ends = [batch["input_ids"][r, batch["attention_mask"][r].sum() - 1] for r in range(6)]
    assert ends == [7, 7, 8, 8, 9, 9]  # copy-major: every prompt's first completion, then the second ...
    assert batch["pixel_values"].shape == prompts[0]["pixel_values"].shape  # the picture once
    assert batch["image_grid_thw"].tolist() == prompts[0]["image_grid_thw"].tolist() * 3
    packed = collate_groups(data.collator(), groups, pack_rows=True)
    assert packed["input_ids"].shape[0] == 1 and packed["attention_mask"].max() == 6
