"""benchmarks/plan_calibration.py: the compute efficiency in devices.yaml is the one fitted to
MindSpeed-MM's published throughput, and with it every calibration run is within 25 %."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from plan_calibration import RUNS, _geomean, efficiency_for, predicted_sps, step_parts  # noqa: E402


def test_devices_yaml_holds_the_fitted_compute_efficiency_and_each_run_is_within_25_percent():
    from mm_train.plan import load_devices

    parts = [step_parts(recipe, config, sets) for _, recipe, config, sets, _ in RUNS]
    fitted = _geomean(efficiency_for(p, run[4]) for p, run in zip(parts, RUNS))
    shipped = load_devices()["efficiency"]["compute"]
    assert abs(shipped - fitted) < 0.005, (shipped, fitted)
    for run, p in zip(RUNS, parts):
        assert abs(predicted_sps(p, shipped) / run[4] - 1) <= 0.25, run[0]
