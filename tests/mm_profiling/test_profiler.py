"""Profiler control captures exactly the configured steps on exactly the configured ranks; the
report renders from the real trace; bad profile sections are clear errors."""

import glob
import os

import pytest
from helpers.profile_cases import STEP_OPS, run_steps


def _operators(save_path, rank):
    from mm_profiling.report import summarize

    traces = glob.glob(os.path.join(save_path, f"rank_{rank}", "**", "trace_view.json"), recursive=True)
    assert len(traces) == 1, traces
    return set(summarize(traces[0])["operators"])


def test_static_capture_is_exactly_steps_start_to_end(tmp_path):
    rank, captured = run_steps(str(tmp_path), start=2, end=4, ranks=[-1])
    assert captured == [2, 3, 4]
    ops = _operators(str(tmp_path), rank)
    assert {STEP_OPS[s] for s in (2, 3, 4)} <= ops
    assert not ops & {STEP_OPS[1], STEP_OPS[5]}


@pytest.mark.distributed
def test_two_processes_only_the_configured_rank_is_profiled(run_distributed, tmp_path):
    results = run_distributed(run_steps, nproc=2, timeout=300, save_path=str(tmp_path), start=3, end=3, ranks=[1])
    assert [list(r) for r in results] == [[0, []], [1, [3]]]
    assert not os.path.exists(tmp_path / "rank_0")
    ops = _operators(str(tmp_path), 1)
    assert STEP_OPS[3] in ops and not ops & {STEP_OPS[s] for s in (1, 2, 4, 5)}


def test_report_renders_from_a_real_trace(tmp_path):
    from mm_profiling.report import main

    run_steps(str(tmp_path / "run"), start=1, end=5, ranks=[-1])
    assert main(["report", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "report.md").read_text()
    assert "| operator | calls | total ms | share |" in text
    assert all(f"| {op} | 1 |" in text for op in STEP_OPS.values())
    assert "communication 0.0 ms" in text
    assert "| step | wall ms | in operators ms |" in text
    step_rows = [line for line in text.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    assert [int(r.split("|")[1]) for r in step_rows] == [1, 2, 3, 4, 5]
    assert all(int(r.split("|")[6]) >= 1 for r in step_rows)  # each step's own operator landed in it
    png = (tmp_path / "out" / "report_0.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    assert main(["report", str(tmp_path / "empty")]) == 2  # no trace: a clear error, not a crash


def test_mm_profile_command(tmp_path):
    """The installed console script (what a person types), not just the function."""
    import shutil
    import subprocess
    import sys

    command = shutil.which("mm-profile") or os.path.join(os.path.dirname(sys.executable), "mm-profile")
    run_steps(str(tmp_path / "run"), start=2, end=2, ranks=[-1])
    done = subprocess.run([command, "report", str(tmp_path / "run"), "--out", str(tmp_path / "out"), "--top", "3"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "out" / "report.md")
    assert "| Sin | 1 |" in (tmp_path / "out" / "report.md").read_text()
    help_text = subprocess.run([command, "report", "--help"], capture_output=True, text=True, timeout=60).stdout
    assert "--out" in help_text


def test_bad_profile_sections_are_clear_errors():
    from mm_profiling.config import ProfileConfig

    with pytest.raises(ValueError, match="did you mean 'start_step'"):
        ProfileConfig.from_dict({"enable": True, "start_stpe": 3})
    with pytest.raises(ValueError, match=r"end_step \(2\) must be >= start_step \(4\)"):
        ProfileConfig.from_dict({"start_step": 4, "end_step": 2})
    with pytest.raises(ValueError, match="level must be 0, 1 or 2"):
        ProfileConfig(level=3)
    with pytest.raises(ValueError, match="type must be one of"):
        ProfileConfig(type="sometimes")
    with pytest.raises(ValueError, match="unknown options"):
        ProfileConfig(ascend={"aic_metric": "PipeUtilization"})
    assert ProfileConfig.from_dict({"enable": True, "ranks": [0, 2]}).profiles_rank(2)
    assert not ProfileConfig.from_dict({"enable": True, "ranks": [0, 2]}).profiles_rank(1)
    with pytest.raises(ValueError, match=r"aic_metrics must be one of \['PipeUtilization'"):
        ProfileConfig(level=1, ascend={"aic_metrics": "pipe"})
    with pytest.raises(ValueError, match="aic_metrics=Memory needs profile.level 1 or 2"):
        ProfileConfig(ascend={"aic_metrics": "Memory"})
    with pytest.raises(ValueError, match=r"\['hbm_ddr'\] are switches"):
        ProfileConfig(ascend={"hbm_ddr": "yes"})


@pytest.mark.filterwarnings("ignore:The parameter '(pcie|hbm_ddr)' will be deprecated")  # MindSpore's notice
@pytest.mark.parametrize("level, ascend", [
    (1, {"aic_metrics": "Memory", "l2_cache": True, "hbm_ddr": True, "pcie": True}),
    (2, {"aic_metrics": "ArithmeticUtilization", "sys_io": True, "sys_interconnection": True}),
    (0, {"aic_metrics": "None", "hbm_ddr": True}),
])
def test_ascend_options_reach_mindspore_as_it_checks_them(level, ascend):
    """The Ascend branch's arguments pass MindSpore's own parameter check (ProfilerParameters, what
    profile() runs them through) unchanged: before, aic_metrics went as a string, which it resets to
    the default with only a log warning, and hbm_ddr / pcie were dropped."""
    from mindspore.profiler import ProfilerActivity, ProfilerLevel
    from mindspore.profiler.common.profiler_parameters import ProfilerParameters

    from mm_profiling.config import ProfileConfig
    from mm_profiling.control import ascend_arguments

    switches, experimental = ascend_arguments(ProfileConfig(level=level, ascend=ascend))
    checked = ProfilerParameters(activities=[ProfilerActivity.CPU, ProfilerActivity.NPU],
                                 profiler_level=[ProfilerLevel.Level0, ProfilerLevel.Level1,
                                                 ProfilerLevel.Level2][level], **switches, **experimental)
    for key, value in ascend.items():
        got = getattr(checked, key)
        assert (got.value if key == "aic_metrics" else got) == value, key


def test_dynamic_capture_follows_edits_of_the_control_file(tmp_path):
    import json

    import numpy as np
    from mindspore import Tensor, ops

    from mm_profiling.config import ProfileConfig
    from mm_profiling.control import StepProfiler

    profiler = StepProfiler(ProfileConfig(enable=True, type="dynamic", save_path=str(tmp_path)), rank=0)
    control = tmp_path / "profiler_config.json"
    assert json.loads(control.read_text()) == {"start_step": -1, "end_step": -1}
    functions = {"Exp": ops.exp, "Sin": ops.sin, "Cos": ops.cos, "Tanh": ops.tanh, "Sigmoid": ops.sigmoid}
    x = Tensor(np.ones((8, 8), np.float32))
    for step in range(1, 6):
        profiler.before_step(step)
        functions[STEP_OPS[step]](x).asnumpy()
        profiler.after_step(step)
        if step == 1:
            control.write_text("{not json")  # a half-saved edit is ignored with a warning
        if step == 2:  # a person edits the file while the run goes on
            control.write_text(json.dumps({"start_step": 3, "end_step": 4}))
    profiler.close()
    assert profiler.captured == [3, 4]
    ops_seen = _operators(str(tmp_path), 0)
    assert {STEP_OPS[3], STEP_OPS[4]} <= ops_seen and not ops_seen & {STEP_OPS[s] for s in (1, 2, 5)}


def test_ascend_only_options_are_ignored_on_cpu_with_one_warning(tmp_path, caplog):
    import logging

    import numpy as np
    from mindspore import Tensor, ops

    from mm_profiling.config import ProfileConfig
    from mm_profiling.control import StepProfiler

    config = ProfileConfig(enable=True, start_step=1, end_step=1, save_path=str(tmp_path), level=1,
                           ascend={"aic_metrics": "PipeUtilization", "l2_cache": True})
    profiler = StepProfiler(config, rank=0)
    with caplog.at_level(logging.WARNING, logger="mm_profiling.control"):
        profiler.before_step(1)
        ops.exp(Tensor(np.ones((4, 4), np.float32))).asnumpy()
        profiler.after_step(1)
    warnings = [r for r in caplog.records if "Ascend only" in r.getMessage()]
    assert len(warnings) == 1 and "aic_metrics" in warnings[0].getMessage()
    assert _operators(str(tmp_path), 0) >= {"Exp"}
