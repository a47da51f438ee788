"""A user's LLaMA-Factory data in its folder: images of several sizes, a video, a system turn and a
broken entry (sft.json), the same entries as renamed data sets of a dataset_info.json, and a tiny
BPE tokenizer of their words (tokenizer.json)."""

import json
from pathlib import Path

from helpers.media import write_image, write_video

TOKEN_TEXT = ["Describe the picture.", "A noisy square.", "What moves?", "A bar moves down.", "Be brief.",
              "user\n", "assistant\n", "system\n"]


def make_user_data(root):
    from mm_train.families.tiny_sets import train_tokenizer
    from mm_train.families.vl.tiny import SPECIAL

    for i, (h, w) in enumerate([(56, 56), (60, 90), (84, 56), (70, 70)]):
        write_image(str(root / f"img{i}.png"), h, w, seed=i)
    write_video(str(root / "clip.mp4"), 12, 56, 84, 6, "libx264")
    entries = [{"messages": [{"role": "user", "content": "<image>Describe the picture."},
                             {"role": "assistant", "content": "A noisy square."}], "images": [f"img{i % 4}.png"]}
               for i in range(10)]
    entries += [{"conversations": [{"from": "system", "value": "Be brief."},
                                   {"from": "human", "value": "<video>What moves?"},
                                   {"from": "gpt", "value": "A bar moves down."}], "videos": ["clip.mp4"]}] * 5
    entries.append({"messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "y"}],
                    "images": ["missing.png"]})
    (root / "sft.json").write_text(json.dumps(entries))
    write_dataset_info(root, entries)
    train_tokenizer(TOKEN_TEXT, Path(root / "tokenizer.json"), SPECIAL)
    return root


def write_dataset_info(root, entries):
    """The same entries as three data sets of a dataset_info.json, in the order of sft.json, with
    their columns and tags renamed (the picture sets' and the clips' layouts differ)."""
    def picture(entry):
        return {"chat": [{"who": {"user": "asker", "assistant": "answerer"}[m["role"]], "says": m["content"]}
                         for m in entry["messages"]], "pics": entry["images"]}

    def clip(entry):
        speakers = {"system": "rules", "human": "person", "gpt": "bot"}
        return {"talk": [{"speaker": speakers[m["from"]], "text": m["value"]} for m in entry["conversations"]],
                "movies": entry["videos"]}

    sets = {"pictures": [picture(e) for e in entries[:10]], "clips": [clip(e) for e in entries[10:15]],
            "broken": [picture(e) for e in entries[15:]]}
    picture_layout = {"formatting": "sharegpt", "columns": {"messages": "chat", "images": "pics"},
                      "tags": {"role_tag": "who", "content_tag": "says", "user_tag": "asker",
                               "assistant_tag": "answerer"}}
    info = {name: dict(picture_layout, file_name=f"{name}.json") for name in ("pictures", "broken")}
    info["clips"] = {"file_name": "clips.json", "formatting": "sharegpt",
                     "columns": {"messages": "talk", "videos": "movies"},
                     "tags": {"role_tag": "speaker", "content_tag": "text", "user_tag": "person",
                              "assistant_tag": "bot", "system_tag": "rules"}}
    for name, content in sets.items():
        (root / f"{name}.json").write_text(json.dumps(content))
    (root / "dataset_info.json").write_text(json.dumps(info))
