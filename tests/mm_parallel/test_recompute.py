"""Recomputation changes no number (single process: full, block and selective equal no recompute),
and multi-process CPU runs are refused rather than corrupted (see mm_parallel.recompute)."""

import pytest

from mm_parallel import ParallelConfig
from mm_parallel.recompute import apply_recompute
from mm_parallel.topology import Topology
from recompute_cases import run_recompute_cases

MODES = ["none", "full", "block1", "selective"]


def test_recompute_single_process_changes_no_number():
    results = run_recompute_cases({"solo": {}}, MODES)
    assert set(results) == {f"solo/{m}/{c}" for m in MODES for c in ("causal", "full")}
    failed = {case: p for case, p in results.items() if p}
    assert not failed, failed


def test_recompute_modes_are_checked():
    from mindspore import nn

    with pytest.raises(ValueError, match="unknown"):
        apply_recompute([], "partial")
    with pytest.raises(ValueError, match="between 1 and the layer count 0"):
        apply_recompute([], "block", num_layers=1)
    with pytest.raises(ValueError, match="found no CoreAttention"):
        apply_recompute([nn.Dense(2, 2)], "selective")


def test_multi_process_cpu_recompute_is_refused():
    two = Topology.build(ParallelConfig(tp=2), 2, 0)
    with pytest.raises(RuntimeError, match="not supported on CPU"):
        apply_recompute([], "full", topology=two)
    assert apply_recompute([], "none", topology=two) == 0
