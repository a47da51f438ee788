"""A VL recipe on the user's own LLaMA-Factory data: images of several sizes, a video, a system
turn and a broken entry, read through mm-data; trains, counts the bad sample, checkpoints the data
position, and resumes (with data worker processes) to the same losses."""

import json

import pytest
from helpers.media import write_image, write_video
from helpers.mm_train_cli import losses, mm_train

TOKEN_TEXT = ["Describe the picture.", "A noisy square.", "What moves?", "A bar moves down.", "Be brief.",
              "user\n", "assistant\n", "system\n"]


@pytest.fixture(scope="module")
def user_data(tmp_path_factory):
    return make_user_data(tmp_path_factory.mktemp("sft"))


def make_user_data(root):
    from pathlib import Path

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
    train_tokenizer(TOKEN_TEXT, Path(root / "tokenizer.json"), SPECIAL)
    return root


def run(root, out, steps, *extra):
    """``mm-train run`` in its own process (a run's random init is drawn once per process)."""

    options = [f"train.steps={steps}", "data.kind=llamafactory", f"data.path={root / 'sft.json'}",
               f"data.tokenizer={root / 'tokenizer.json'}", "data.min_pixels=3136", "data.max_pixels=6272",
               "data.video_fps=3", "data.max_bad_fraction=0.2", "train.global_batch_size=4",
               "train.micro_batch_size=2", "checkpoint.every=2", f"output_dir={out}"]
    result = mm_train("run", *[a for o in options for a in ("--set", o)], "--no-progress", *extra, data=root / "tiny")
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(out), result.stderr


def test_llamafactory_data_trains_and_resumes(user_data, tmp_path):
    full, log = run(user_data, tmp_path / "full", 4)
    assert full[-1] < full[0]
    assert "skipped bad sample 1" in log and "missing.png: file not found" in log
    rows = [json.loads(line) for line in (tmp_path / "full" / "bad_samples.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["source"].endswith("missing.png") and "file not found" in rows[0]["reason"]
    assert "; 1 bad samples skipped (" in log.strip().splitlines()[-1]
    run(user_data, tmp_path / "cut", 2)
    state = json.loads((tmp_path / "cut" / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    assert state["data"] == {"epoch": 0, "position": 2, "seed": 0, "global_batch_size": 4}
    resumed, _ = run(user_data, tmp_path / "cut", 4, "--resume", "--set", "data.num_workers=2")
    assert resumed == full  # bit for bit: the stream continued at step 2, made by two worker processes


def test_a_missing_dataset_file_is_a_config_error(tmp_path):
    with pytest.raises(ValueError, match="needs data.path"):
        from mm_train.recipe import load_recipe

        load_recipe(None, ["data.kind=llamafactory"])
