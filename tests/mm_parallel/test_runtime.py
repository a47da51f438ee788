"""Custom-bprop Cells get their bprop called on every backward once mm_parallel is imported
(MindSpore 2.7.2 skips some under asynchronous launch: see mm_parallel.runtime)."""

import json

import pytest

from mm_parallel import runtime


def test_custom_bprop_runs_on_every_step():
    """The self-check's loop (four identity Cells whose bprop doubles the gradient, 300 steps) after
    `import mm_parallel`: every step equals the numpy gradient, every bprop ran (with asynchronous
    launch 13-48 steps came out wrong here, measured)."""
    result = runtime.self_check("CPU", through_mm_parallel=True)
    assert result["passed"] and result["wrong"] == 0 and result["calls"] == 1200, result


def test_device_choice():
    none, some = (lambda: False), (lambda: True)
    assert runtime.chosen_device("auto", {}, none) == ("CPU", "train.device=auto: MindSpore reports no Ascend")
    assert runtime.chosen_device("auto", {}, some) == ("Ascend", "train.device=auto: MindSpore reports Ascend")
    assert runtime.chosen_device("ascend", {"MM_DEVICE": "cpu"}, some) == ("CPU", "MM_DEVICE=cpu")
    with pytest.raises(ValueError, match="cannot run on Ascend .* or set train.device to cpu / auto"):
        runtime.chosen_device("ascend", {}, none)
    with pytest.raises(ValueError, match="MM_DEVICE='npu' is not a device; use one of auto, cpu, ascend"):
        runtime.chosen_device("cpu", {"MM_DEVICE": "npu"}, some)
    assert runtime.decisions["device"].startswith("device CPU (")  # import mm_parallel chose and said it


def test_launch_mode_follows_the_self_check_off_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("MM_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MM_LAUNCH_BLOCKING", raising=False)
    assert runtime.launch_mode("CPU")[0] and not runtime.launch_mode("Ascend")[0]  # unchecked
    for target, passed in (("CPU", True), ("Ascend", True)):
        runtime._cache_file(target).parent.mkdir(parents=True, exist_ok=True)
        runtime._cache_file(target).write_text(json.dumps({"passed": passed, "wrong": 0 if passed else 7,
                                                           "steps": 300}))
    # a passed check on CPU is luck (the fault comes and goes there): CPU stays blocking
    assert runtime.launch_mode("CPU")[0] and runtime.launch_mode("CPU")[1].startswith("always on CPU")
    assert runtime.launch_mode("Ascend") == (False, "self-check on Ascend: 0 of 300 steps wrong under "
                                                    "asynchronous launch")
    runtime._cache_file("Ascend").write_text(json.dumps({"passed": False, "wrong": 7, "steps": 300}))
    assert runtime.launch_mode("Ascend") == (True, "self-check on Ascend: 7 of 300 steps wrong under "
                                                   "asynchronous launch")
    monkeypatch.setenv("MM_LAUNCH_BLOCKING", "0")
    assert runtime.launch_mode("CPU") == (False, "MM_LAUNCH_BLOCKING=0")
    monkeypatch.setenv("MM_LAUNCH_BLOCKING", "1")
    assert runtime.launch_mode("Ascend") == (True, "MM_LAUNCH_BLOCKING=1")
    monkeypatch.setenv("MM_LAUNCH_BLOCKING", "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        runtime.launch_mode("CPU")


def test_the_self_check_finds_the_skipped_bprops_on_cpu():
    """What mm-train runs once per Ascend device (and the doctor everywhere): the loop above with
    asynchronous launch, in a fresh process. On this CPU it fails on most runs (13-45 of 300 steps
    wrong, measured) but not on every one (a CI run's doctor found 0): up to three runs, each kept
    apart, and one of them must find the fault. When a MindSpore version fixes it, this fails: the
    signal to let CPU runs use asynchronous launch again."""
    results = []
    for _ in range(3):
        results.append(runtime.self_check("CPU", save=False))
        if not results[-1]["passed"]:
            break
    result = results[-1]
    assert not result["passed"] and result["steps"] == 300, results
    assert result["wrong"] > 0 or result["calls"] < 1200, results


def test_a_self_check_that_outlives_its_limit_fails():
    """One CI run's loop hung under asynchronous launch for 600 s: a loop past its limit is a failed
    check (as unsafe as a skipped bprop), not an error that stops the run. Here the limit is shorter
    than MindSpore's import."""
    result = runtime.self_check("CPU", timeout=0.5, save=False)
    assert not result["passed"] and result["wrong"] == "hung" and result["calls"] == 0, result
