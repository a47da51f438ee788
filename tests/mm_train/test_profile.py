"""A recipe's profile section drives mm-profiling's step profiler inside the training loop:
exactly steps start_step..end_step are captured, into OUT/profile, and the report reads them."""

import glob
import json


def test_profile_section_captures_the_chosen_steps(tmp_path):
    from mm_profiling.report import report
    from mm_train import loop
    from mm_train.recipe import load_recipe

    recipe = load_recipe(None, ["train.steps=4", "data.samples=32", f"data.path={tmp_path / 'data'}",
                                "profile.enable=true", "profile.start_step=2", "profile.end_step=3",
                                f"output_dir={tmp_path / 'out'}"])
    loop.train(recipe, progress=False)
    rank0 = tmp_path / "out" / "profile" / "rank_0"
    steps = json.loads((rank0 / "steps_2.json").read_text())["steps"]
    assert [s["step"] for s in steps] == [2, 3] and all(s["end_us"] > s["start_us"] for s in steps)
    assert glob.glob(str(rank0 / "**" / "trace_view.json"), recursive=True)
    assert report(str(tmp_path / "out" / "profile"))
