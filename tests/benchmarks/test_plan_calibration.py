"""benchmarks/plan_calibration.py: devices.yaml holds the efficiencies fitted per device group on
calibration.yaml's measured figures, every figure names its source, and the leave-one-out goal
(within 25 % on at least 80 % of the figures that have one) holds."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from plan_calibration import GOAL, SHARE, load_table, rows  # noqa: E402


def test_every_figure_says_where_it_comes_from_and_left_out_ones_say_why():
    table = load_table()
    for figure in table["figures"]:
        assert figure["source"] in table["sources"] and figure["column"] in ("npu", "reference"), figure["name"]
        assert figure["framework"] in ("torch_npu", "mindspore") and figure["unit"] in ("SPS", "TPS")
        assert figure["use"] in ("fit", "left_out") and figure["script"], figure["name"]
        assert figure["use"] == "fit" or figure["reason"], figure["name"]
        assert figure["column"] == "npu" or figure["use"] == "left_out", figure["name"]  # never fit a reference


def test_devices_yaml_holds_the_fitted_efficiencies_and_the_leave_one_out_goal_holds():
    from mm_train.plan import load_devices

    out, groups = rows()
    shipped = load_devices()["calibrated"]
    for group, constants in groups.items():
        assert tuple(shipped[group][k] for k in ("compute", "layer_pass_ms", "encode")) == constants, group
    judged = [r for r in out if r["use"] == "fit" and r["loo"] is not None]
    assert len(judged) >= 16 and {r["device"] for r in judged} >= {"ascend-910b2", "ascend-910c"}
    assert sum(abs(r["loo"]) <= GOAL for r in judged) >= SHARE * len(judged)
