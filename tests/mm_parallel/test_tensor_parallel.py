"""Tensor parallel (with and without sequence parallel) equals the single process: loss and
gathered gradients of a tiny LM block, on 2 and 4 processes; plus single-process checks."""

import numpy as np
import pytest
from helpers.tp_cases import run_tp_cases
from mindspore import Tensor

from mm_parallel import ParallelConfig
from mm_parallel.tensor_parallel import ColumnParallelLinear, shard, vocab_parallel_cross_entropy
from mm_parallel.topology import Topology


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_equals_single_process(run_distributed, tp):
    results = run_distributed(run_tp_cases, nproc=tp, timeout=300, tp=tp)
    names = set(results[0])
    assert names == {f"tp{tp}", f"tp{tp}_sp", f"tp{tp}_gather_scatter"}
    for rank, result in enumerate(results):
        for name, outcome in result.items():
            assert not outcome["problems"], (rank, name, outcome)
            assert outcome["loss"] == pytest.approx(results[0][name]["loss"], rel=1e-6)


def test_vocab_cross_entropy_equals_numpy_on_one_rank():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 3, (2, 5, 11)).astype(np.float32)
    labels = rng.integers(0, 11, (2, 5)).astype(np.int32)
    labels[1, 3] = -100
    group = Topology.build(ParallelConfig(), 1, 0).tp
    got = vocab_parallel_cross_entropy(Tensor(logits), Tensor(labels), group, reduction="none").asnumpy()
    z = logits.astype(np.float64)
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    want = lse - np.take_along_axis(z, np.maximum(labels, 0)[..., None], -1)[..., 0]
    want[labels == -100] = 0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    mean = vocab_parallel_cross_entropy(Tensor(logits), Tensor(labels), group).asnumpy()
    np.testing.assert_allclose(mean, want.sum() / 9, rtol=1e-5)


def test_shard_helper_and_layout_errors():
    topo = Topology.build(ParallelConfig(tp=2), 2, 1)
    full = np.arange(12).reshape(4, 3)
    np.testing.assert_array_equal(shard(full, topo.tp, 0), full[2:])
    with pytest.raises(ValueError, match="must be a multiple of 2"):
        shard(full, topo.tp, 1)
    solo = Topology.build(ParallelConfig(), 1, 0)
    layer = ColumnParallelLinear(3, 4, topology=solo)
    with pytest.raises(ValueError, match="expected"):
        layer.load_full(weight=np.zeros((5, 3)))


def test_initialisation_is_the_same_model_under_any_tp(monkeypatch):
    import itertools

    from mm_parallel import tensor_parallel

    def build(tp, rank):
        monkeypatch.setattr(tensor_parallel, "_init_count", itertools.count())  # a fresh process
        topo = Topology.build(ParallelConfig(tp=tp), tp, rank)
        return ColumnParallelLinear(4, 6, topology=topo), tensor_parallel.RowParallelLinear(6, 4, topology=topo)

    column, row = build(1, 0)
    for rank in (0, 1):
        column_shard, row_shard = build(2, rank)
        np.testing.assert_array_equal(column_shard.weight.asnumpy(), column.weight.asnumpy()[rank * 3:(rank + 1) * 3])
        np.testing.assert_array_equal(row_shard.weight.asnumpy(), row.weight.asnumpy()[:, rank * 3:(rank + 1) * 3])
