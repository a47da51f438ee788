"""benchmarks/zero_memory.py's measurement on one and two processes: per-rank parameter, gradient-sum
and optimizer bytes, taken from the tensors, equal the formula in fp32 and bf16 (bf16 parameters
2 B, fp32 gradient sums 4 B, master + moments 12 B / dp under ZeRO; under ZeRO-3 the weight
slices, their gradients and moments 4 + 4 + 8 B / dp, the values left whole aside, and the
offloaded state all in host memory); the whole-step comparison runs."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from zero_memory import measure, step  # noqa: E402

pytestmark = pytest.mark.distributed


def check(result, dp):
    numel = result["fp32"]["numel"]
    for name, param_bytes in (("fp32", 4), ("bf16", 2)):
        got = result[name]
        assert got["numel"] == numel
        assert got["params"] == param_bytes * numel and got["grads"] == 4 * numel
        assert got["optimizer"]["0"] == 12 * numel
        for stage in ("1", "2"):
            padded = -(-numel // dp) * dp  # one bucket here: padded to a multiple of dp
            assert got["optimizer"].get(stage, 12 * padded // dp) == 12 * padded // dp, (name, stage)


def check_zero3(result, dp):
    """Slices are float32 and their own master weights: 4 + 4 + 8 bytes per sliced value / dp."""
    numel = result["fp32"]["numel"]
    for name, param_bytes in (("fp32", 4), ("bf16", 2)):
        got = result[name]["zero3"]
        whole = got["whole_numel"]
        assert 0 < whole < numel / 10  # norms and biases
        sliced = (numel - whole) // dp  # hidden 64: every weight a multiple of dp, no padding
        assert got["params"] == 4 * sliced + param_bytes * whole and got["grads"] == 4 * (sliced + whole), name
        padded = -(-whole // dp) * dp  # the whole ones' bucket
        assert got["optimizer"] == 8 * sliced + 12 * padded // dp, name
        assert got["offloaded_device"] == 0 and got["offloaded_host"] == 12 * sliced + 12 * padded // dp, name


def test_bytes_per_rank_equal_the_formula(run_distributed):
    check(measure(1, 64, [0]), 1)
    for rank_result in run_distributed(measure, nproc=2, timeout=300, layers=1, hidden=64, stages=[0, 1, 2, 3]):
        check(rank_result, 2)
        check_zero3(rank_result, 2)
    for stage, offload in ((1, False), (3, True)):
        for rank_result in run_distributed(step, nproc=2, timeout=300, layers=1, hidden=64, stage=stage,
                                           offload=offload):
            assert rank_result["peak_bytes"] >= 0 and rank_result["step_s"] > 0
