"""benchmarks/plan_calibration.py: devices.yaml holds the constants fitted to MindSpeed-MM's
published throughput, and with them every calibration run is within 25 %."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from plan_calibration import RUNS, fit, predicted_sps, step_parts  # noqa: E402


def test_devices_yaml_holds_the_fitted_efficiencies_and_each_run_is_within_25_percent():
    from mm_train.plan import load_devices

    parts = [step_parts(recipe, config, sets) for _, recipe, config, sets, _ in RUNS]
    efficiency, layer_pass, encode = fit(parts, [run[4] for run in RUNS])
    shipped = load_devices()["efficiency"]
    assert (shipped["compute"], shipped["layer_pass_ms"], shipped["encode"]) == (efficiency, layer_pass, encode)
    assert any(p["encode"] for p in parts)  # the CogVideoX run encodes online, as MindSpeed-MM's script does
    for run, p in zip(RUNS, parts):
        predicted = predicted_sps(p, shipped["compute"], shipped["layer_pass_ms"], shipped["encode"])
        assert abs(predicted / run[4] - 1) <= 0.25, run[0]
