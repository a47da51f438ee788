"""A VL recipe on the user's own LLaMA-Factory data: images of several sizes, a video, a system
turn and a broken entry, read through mm-data; trains, counts the bad sample, checkpoints the data
position, and resumes (with data worker processes) to the same losses — also when the same samples
are declared in a dataset_info.json with renamed columns and tags."""

import json

import pytest
from helpers.llamafactory_data import make_user_data
from helpers.mm_train_cli import losses, mm_train


@pytest.fixture(scope="module")
def user_data(tmp_path_factory):
    return make_user_data(tmp_path_factory.mktemp("sft"))


def run(root, out, steps, *extra, dataset_info=False):
    """``mm-train run`` in its own process (a run's random init is drawn once per process); the
    data read from sft.json, or with ``dataset_info`` from the renamed data sets of dataset_info.json."""
    source = ([f"data.dataset_info={root}", "data.dataset=[pictures, clips, broken]"] if dataset_info
              else [f"data.path={root / 'sft.json'}"])
    options = [f"train.steps={steps}", "data.kind=llamafactory", *source,
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
    # the same samples declared in a dataset_info.json with renamed columns and tags
    run(user_data, tmp_path / "cut", 2, dataset_info=True)
    state = json.loads((tmp_path / "cut" / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    assert state["data"] == {"epoch": 0, "position": 2, "seed": 0, "global_batch_size": 4}
    resumed, _ = run(user_data, tmp_path / "cut", 4, "--resume", "--set", "data.num_workers=2", dataset_info=True)
    assert resumed == full  # bit for bit: the stream continued at step 2, made by two worker processes


def test_a_missing_dataset_file_is_a_config_error(tmp_path):
    from mm_train.recipe import load_recipe

    with pytest.raises(ValueError, match="needs data.path"):
        load_recipe(None, ["data.kind=llamafactory"])
    with pytest.raises(ValueError, match="data.dataset_info and data.dataset go together"):
        load_recipe(None, ["data.kind=llamafactory", f"data.dataset_info={tmp_path}"])


def test_a_wrong_data_set_name_is_refused_before_launch(user_data):
    from mm_train.preflight import check_before_launch
    from mm_train.recipe import load_recipe

    recipe = load_recipe(None, ["data.kind=llamafactory", f"data.dataset_info={user_data}", "data.dataset=picture",
                                f"data.tokenizer={user_data / 'tokenizer.json'}"])
    with pytest.raises(ValueError, match=r"dataset_info.json: no data set named \['picture'\]; it has "
                                         r"\['broken', 'clips', 'pictures'\]"):
        check_before_launch(recipe)
