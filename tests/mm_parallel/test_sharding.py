"""The per-parameter sharding spec: slices of split and fused tensors, gathering them back, the
spec carried by the layers; and a toy expert parameter over ep=2 inside dp=4 (load, ZeRO-1 over
expert-dp, save, resume under ep=1), each equal to one process."""

import numpy as np
import pytest

from mm_parallel.sharding import ParamSharding


class _Group:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size


class _Topo:
    def __init__(self, tp=(0, 1), ep=(0, 1)):
        self.groups = {"tp": _Group(*tp), "ep": _Group(*ep)}
        self.tp = self.groups["tp"]


def test_a_split_dim_takes_this_ranks_equal_part():
    full = np.arange(24).reshape(4, 6)
    spec = ParamSharding(splits=((1, "tp"),))
    assert spec.local(full, _Topo(tp=(1, 2))).tolist() == full[:, 3:].tolist()
    assert spec.local(full, _Topo(tp=(0, 1))).tolist() == full.tolist()


def test_experts_over_ep_and_their_rows_over_tp():
    full = np.arange(4 * 4 * 2).reshape(4, 4, 2)
    spec = ParamSharding(splits=((0, "ep"), (1, "tp")), grad_sync="edp")
    np.testing.assert_array_equal(spec.local(full, _Topo(tp=(1, 2), ep=(1, 2))), full[2:, 2:])


def test_fused_parts_are_cut_one_by_one():
    """q | k | v fused along dim 0 with sizes 4, 2, 2: tp rank 1 of 2 holds q[2:4], k[1:2], v[1:2]."""
    full = np.arange(8)
    spec = ParamSharding(splits=((0, "tp"),), fused=(4, 2, 2))
    assert spec.local(full, _Topo(tp=(1, 2))).tolist() == [2, 3, 5, 7]
    assert spec.local(full, _Topo(tp=(0, 2))).tolist() == [0, 1, 4, 6]
    gathered = np.concatenate([spec.local(full, _Topo(tp=(r, 2))) for r in range(2)])
    assert gathered[np.argsort(spec.fused_rows(2))].tolist() == full.tolist()


@pytest.mark.parametrize("spec, message", [
    (dict(splits=((0, "tp"), (0, "ep"))), "one group only"),
    (dict(splits=((0, "dp"),)), "each group once"),
    (dict(grad_sync="world"), "grad_sync"),
    (dict(fused=(2, 2)), "tp split"),
])
def test_bad_specs_are_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        ParamSharding(**spec)


def test_a_dim_the_group_cannot_divide_names_the_fix():
    with pytest.raises(ValueError, match="cannot be split over tp=3"):
        ParamSharding(splits=((0, "tp"),)).local_index((4, 2), _Topo(tp=(0, 3)))


def test_the_layers_declare_their_sharding():
    from mm_parallel import ColumnParallelLinear, ParallelConfig, RowParallelLinear, VocabParallelEmbedding
    from mm_parallel.sharding import sharding_of
    from mm_parallel.topology import Topology

    topo = Topology.build(ParallelConfig(tp=2, sequence_parallel=True), 2, 0)
    column, row = ColumnParallelLinear(4, 6, topology=topo), RowParallelLinear(6, 4, topology=topo)
    assert sharding_of(column.weight).dim("tp") == 0 and sharding_of(column.bias).dim("tp") == 0
    assert sharding_of(row.weight).dim("tp") == 1 and sharding_of(row.bias).splits == ()
    assert sharding_of(row.bias).partial_over_tp  # added on a sequence shard
    assert sharding_of(VocabParallelEmbedding(8, 4, topology=topo).weight).dim("tp") == 0


@pytest.mark.distributed
def test_expert_parameters_over_ep_equal_one_process(run_distributed, tmp_path):
    from helpers.sharding_cases import run_sharding_cases

    for rank, problems in enumerate(run_distributed(run_sharding_cases, nproc=4, timeout=300, root=str(tmp_path))):
        assert not problems, (rank, problems)
