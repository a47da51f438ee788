"""Recomputation changes no number: three AdamW steps with full, block and selective recompute
equal the steps without it (one process here; under tp / sp / cp in test_training.py); and it
happens: the recomputed cells' forwards run again in the backward, the others' do not."""

import numpy as np
import pytest
from helpers.forward_counts import counted_forwards
from helpers.reference_model import H, build_stack, run_stack
from helpers.training_cases import run_training_cases

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


@pytest.mark.parametrize("mode, blocks, cores", [("none", [1, 1, 1], [1, 1, 1]), ("full", [2, 2, 2], [2, 2, 2]),
                                                 ("block", [2, 2, 1], [2, 2, 1]), ("selective", [1, 1, 1], [2, 2, 2])])
def test_recomputed_cells_run_their_forward_again_in_the_backward(mode, blocks, cores):
    import mindspore as ms

    solo = Topology.build(ParallelConfig(), 1, 0)
    stack = build_stack(solo)
    params = [p for block in stack for p in block.trainable_params()]
    grad = ms.value_and_grad(lambda x: run_stack(stack, x).sum(), None, params)
    x = ms.Tensor(np.random.default_rng(0).normal(size=(2, 8, H)).astype(np.float32))
    # counted before marking: Cell.recompute() wraps the construct it finds
    with counted_forwards(list(stack)) as block_calls, counted_forwards([b.core for b in stack]) as core_calls:
        apply_recompute(stack, mode, num_layers=2 if mode == "block" else None)
        grad(x)
    assert list(block_calls.values()) == blocks and list(core_calls.values()) == cores


def test_recompute_modes_are_checked():
    from mindspore import nn

    with pytest.raises(ValueError, match="unknown"):
        apply_recompute([], "partial")
    with pytest.raises(ValueError, match="between 1 and the layer count 0"):
        apply_recompute([], "block", num_layers=1)
    with pytest.raises(ValueError, match="found no CoreAttention"):
        apply_recompute([nn.Dense(2, 2)], "selective")
