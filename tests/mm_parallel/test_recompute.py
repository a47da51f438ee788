"""Recomputation changes no number: three AdamW steps with full, block and selective recompute
equal the steps without it (one process here; under tp / sp / cp in test_training.py)."""

import pytest
from reference_model import build_stack
from training_cases import run_training_cases

from mm_parallel import ParallelConfig
from mm_parallel.recompute import apply_recompute
from mm_parallel.topology import Topology

MODES = ["none", "full", "block1", "selective"]


def test_recompute_single_process_changes_no_number():
    results = run_training_cases({"solo": {"layout": {}, "recompute": MODES, "causal": [True, False]}})
    assert set(results) == {f"solo/{m}/{c}" for m in MODES for c in ("causal", "full")}
    failed = {case: p for case, p in results.items() if p}
    assert not failed, failed


def test_recompute_marks_the_right_cells():
    solo = Topology.build(ParallelConfig(), 1, 0)
    assert apply_recompute(build_stack(solo), "none") == 0
    assert apply_recompute(build_stack(solo), "full") == 3
    assert apply_recompute(build_stack(solo), "block", num_layers=2) == 2
    assert apply_recompute(build_stack(solo), "selective") == 3  # one CoreAttention per layer


def test_recompute_modes_are_checked():
    from mindspore import nn

    with pytest.raises(ValueError, match="unknown"):
        apply_recompute([], "partial")
    with pytest.raises(ValueError, match="between 1 and the layer count 0"):
        apply_recompute([], "block", num_layers=1)
    with pytest.raises(ValueError, match="found no CoreAttention"):
        apply_recompute([nn.Dense(2, 2)], "selective")
