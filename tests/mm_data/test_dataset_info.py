"""LLaMA-Factory's dataset_info.json: renamed columns and tags read the same samples as the
default layout; alpaca, ranking sets and num_samples as LLaMA-Factory reads them; a wrong name,
key or file is an error naming the data set and the key."""

import dataclasses
import json

import pytest

from mm_data.errors import BadInputLog
from mm_data.vl.conversation import read_conversations, read_datasets
from mm_data.vl.dataset_info import load_dataset_info

DEFAULT = [
    {"conversations": [{"from": "human", "value": "<image>What colour?"}, {"from": "gpt", "value": "Red."},
                       {"from": "human", "value": "And the shape?"}, {"from": "gpt", "value": "A disc."}],
     "system": "Be brief.", "images": ["a.png"]},
    {"conversations": [{"from": "system", "value": "Answer."}, {"from": "human", "value": "Hello"},
                       {"from": "gpt", "value": "Hi."}]},
]
RENAMED = [
    {"dialog": [{"speaker": "person", "text": "<image>What colour?"}, {"speaker": "bot", "text": "Red."},
                {"speaker": "person", "text": "And the shape?"}, {"speaker": "bot", "text": "A disc."}],
     "sys": "Be brief.", "pictures": ["a.png"]},
    {"dialog": [{"speaker": "rules", "text": "Answer."}, {"speaker": "person", "text": "Hello"},
                {"speaker": "bot", "text": "Hi."}]},
]
INFO = {
    "default": {"file_name": "default.json", "formatting": "sharegpt", "columns": {"system": "system"}},
    "renamed": {"file_name": "renamed.json", "formatting": "sharegpt",
                "columns": {"messages": "dialog", "system": "sys", "images": "pictures"},
                "tags": {"role_tag": "speaker", "content_tag": "text", "user_tag": "person", "assistant_tag": "bot",
                         "system_tag": "rules"}},
    "alpaca": {"file_name": "alpaca.json", "columns": {"history": "history", "system": "system", "images": "images"}},
    "pairs": {"file_name": "pairs.json", "formatting": "sharegpt", "ranking": True},
    "alpaca_pairs": {"file_name": "alpaca_pairs.json", "ranking": True},
    "two": {"file_name": "default.json", "formatting": "sharegpt", "num_samples": 1},
    "hub": {"hf_hub_url": "someone/something"},
}


@pytest.fixture
def folder(tmp_path):
    files = {
        "default.json": DEFAULT, "renamed.json": RENAMED,
        "alpaca.json": [{"instruction": "And the shape?", "input": "", "output": "A disc.", "system": "Be brief.",
                         "history": [["<image>What colour?", "Red."]], "images": ["a.png"]}],
        "pairs.json": [{"conversations": [{"from": "human", "value": "Hello"}],
                        "chosen": {"from": "gpt", "value": "Hi."}, "rejected": {"from": "gpt", "value": "Go away."}}],
        "alpaca_pairs.json": [{"instruction": "Hello", "input": "there", "chosen": "Hi.", "rejected": "Go away."}],
        "dataset_info.json": INFO,
    }
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    return tmp_path


def _plain(conversations):
    return [dataclasses.replace(c, source="") for c in conversations]


def test_renamed_columns_and_tags_read_the_samples_of_the_default_layout(folder):
    plain = _plain(read_conversations(str(folder / "default.json")))
    assert plain[0].system == "Be brief." and plain[1].system == "Answer." and len(plain[0].turns) == 4
    for name in ("default", "renamed"):
        assert _plain(read_datasets(load_dataset_info(str(folder), name))) == plain, name


def test_alpaca_history_and_system_make_the_same_conversation(folder):
    (alpaca,) = _plain(read_datasets(load_dataset_info(str(folder / "dataset_info.json"), ["alpaca"])))
    assert alpaca == _plain(read_conversations(str(folder / "default.json")))[0]


def test_ranking_sets_end_in_the_chosen_answer_and_keep_the_rejected_one(folder):
    pair, alpaca_pair = read_datasets(load_dataset_info(str(folder), ["pairs", "alpaca_pairs"]))
    assert pair.turns == (("user", "Hello"), ("assistant", "Hi.")) and pair.rejected == "Go away."
    assert alpaca_pair.turns == (("user", "Hello\nthere"), ("assistant", "Hi.")) and alpaca_pair.rejected == "Go away."


def test_sets_are_read_in_order_and_num_samples_keeps_the_first(folder):
    got = read_datasets(load_dataset_info(str(folder), ["two", "pairs"]))
    assert [c.turns[-1][1] for c in got] == ["A disc.", "Hi."]


@pytest.mark.parametrize("names, change, match", [
    (["nothing"], {}, r"no data set named \['nothing'\]; it has"),
    (["hub"], {}, r"data set 'hub': hf_hub_url is a hub data set: mm reads local files only"),
    (["renamed"], {"renamed": {"file_name": "renamed.json", "formatting": "sharegpt", "columns": {"msgs": "x"}}},
     r"data set 'renamed': unknown columns key\(s\) \['msgs'\]"),
    (["renamed"], {"renamed": {"file_name": "gone.json"}}, r"data set 'renamed': file_name 'gone.json'"),
    (["renamed"], {"renamed": {"file_name": "renamed.json", "formatting": "openai"}},
     r"data set 'renamed': formatting 'openai' is not one of"),
])
def test_wrong_names_keys_and_files_are_errors_naming_the_set_and_key(folder, names, change, match):
    (folder / "dataset_info.json").write_text(json.dumps({**INFO, **change}))
    with pytest.raises(ValueError, match=match):
        load_dataset_info(str(folder), names)


def test_a_tool_turn_is_a_counted_bad_sample(folder):
    entries = DEFAULT + [{"conversations": [{"from": "human", "value": "Weather?"},
                                            {"from": "function_call", "value": "{}"}]}]
    (folder / "default.json").write_text(json.dumps(entries))
    log = BadInputLog(max_bad_fraction=0.5)
    assert len(read_datasets(load_dataset_info(str(folder), "default"), log=log)) == 2
    assert log.count == 1 and "tool turn ('function_call')" in log.skipped[0][1]


def test_sets_named_with_ratios_are_mixed_in_those_shares_until_one_runs_out(folder):
    many = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(400)]
    few = [{"instruction": f"Q{i}", "input": "", "output": f"A{i}"} for i in range(100)]
    (folder / "many.json").write_text(json.dumps(many))
    (folder / "few.json").write_text(json.dumps(few))
    info = {**INFO, "many": {"file_name": "many.json"}, "few": {"file_name": "few.json"}}
    (folder / "dataset_info.json").write_text(json.dumps(info))
    formats = load_dataset_info(str(folder), {"many": 3, "few": 1})
    assert [f.ratio for f in formats] == [0.75, 0.25]
    mixed = [c.turns[0][1] for c in read_datasets(formats)]
    from_few = sum(text.startswith("Q") for text in mixed)
    assert from_few == 100 and 0.2 < from_few / len(mixed) < 0.35  # the short set runs out first: the end
    assert [t for t in mixed if t.startswith("q")] == [f"q{i}" for i in range(len(mixed) - from_few)]  # in order
    assert [c.turns[0][1] for c in read_datasets(formats)] == mixed  # deterministic
    with pytest.raises(ValueError, match="ratios must be positive numbers"):
        load_dataset_info(str(folder), {"many": 0, "few": 1})


def test_pairs_are_told_from_the_entry_and_bad_pairs_are_counted(tmp_path):
    """Without a dataset_info.json an entry with chosen / rejected answers is a pair (either chat
    layout; an assistant message or its text); a missing side or equal answers are bad samples."""
    entries = [
        {"messages": [{"role": "user", "content": "<image>What colour?"}], "images": ["a.png"],
         "chosen": {"role": "assistant", "content": "Red."}, "rejected": {"role": "assistant", "content": "Blue."}},
        {"conversations": [{"from": "human", "value": "Hello"}], "chosen": "Hi.", "rejected": "Go away."},
        {"conversations": [{"from": "human", "value": "Hello"}], "chosen": "Hi."},
        {"conversations": [{"from": "human", "value": "Hello"}], "chosen": "Hi.", "rejected": "Hi."},
    ]
    (tmp_path / "pairs.json").write_text(json.dumps(entries))
    log = BadInputLog(max_bad_fraction=0.5)
    image, text = read_conversations(str(tmp_path / "pairs.json"), log=log)
    assert image.turns == (("user", "<image>What colour?"), ("assistant", "Red.")) and image.rejected == "Blue."
    assert image.images == (str(tmp_path / "a.png"),)
    assert text.turns == (("user", "Hello"), ("assistant", "Hi.")) and text.rejected == "Go away."
    reasons = " | ".join(reason for _, reason in log.skipped)
    assert log.count == 2 and "'rejected' is missing" in reasons and "answers are the same" in reasons, reasons
