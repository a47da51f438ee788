"""ParallelConfig rules and the rank grid (pure: no processes), and the world of one."""

import itertools

import numpy as np
import pytest

import mm_parallel
from mm_parallel import ParallelConfig, comm, mappings
from mm_parallel.topology import Topology, rank_grid


def groups_of(config, world_size, kind):
    return rank_grid(config, world_size)[kind]


def test_design_example_tp2_cp2():
    config = ParallelConfig(tp=2, cp=2)
    assert groups_of(config, 4, "tp") == [[0, 1], [2, 3]]
    assert groups_of(config, 4, "cp") == [[0, 2], [1, 3]]
    assert groups_of(config, 4, "dp") == [[0], [1], [2], [3]]


def test_megatron_order_tp_cp_dp_pp_on_16_ranks():
    config = ParallelConfig(tp=2, cp=2, pp=2)  # dp = 2
    assert groups_of(config, 16, "tp")[:2] == [[0, 1], [2, 3]]
    assert groups_of(config, 16, "cp")[:2] == [[0, 2], [1, 3]]
    assert groups_of(config, 16, "dp")[:2] == [[0, 4], [1, 5]]
    assert groups_of(config, 16, "pp")[:2] == [[0, 8], [1, 9]]
    assert groups_of(config, 16, "dp_cp")[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_rank_formula_matches_every_group():
    config = ParallelConfig(tp=2, cp=3, pp=2)
    world = 24  # dp = 2
    for rank in range(world):
        topo = Topology.build(config, world, rank)
        tp_r, cp_r, dp_r, pp_r = topo.tp.rank, topo.cp.rank, topo.dp.rank, topo.pp.rank
        assert rank == tp_r + 2 * (cp_r + 3 * (dp_r + 2 * pp_r))
        for kind in ("tp", "cp", "dp", "pp", "dp_cp", "ep", "edp", "cp_ulysses", "cp_ring"):
            group = getattr(topo, kind)
            assert group.ranks[group.rank] == rank and list(group.ranks) == sorted(group.ranks)


@pytest.mark.parametrize("tp,cp,pp,ep,world", [(1, 1, 1, 2, 4), (2, 2, 1, 2, 8), (1, 2, 1, 4, 8), (2, 1, 2, 2, 8)])
def test_groups_partition_the_world(tp, cp, pp, ep, world):
    grid = rank_grid(ParallelConfig(tp=tp, cp=cp, pp=pp, ep=ep), world)
    for kind, rows in grid.items():
        flat = sorted(itertools.chain(*rows))
        assert flat == list(range(world)), kind
        assert len({len(r) for r in rows}) == 1, kind
    dp = world // (tp * cp * pp)
    assert len(grid["ep"][0]) == ep and len(grid["edp"][0]) == dp * cp // ep


def test_expert_groups_are_carved_out_of_dp_times_cp():
    config = ParallelConfig(tp=2, cp=2, ep=2)  # world 8: dp = 2
    assert groups_of(config, 8, "ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups_of(config, 8, "edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for row in groups_of(config, 8, "ep"):
        tp_positions = {r % 2 for r in row}
        assert len(tp_positions) == 1  # an expert group never mixes tensor-parallel positions


def test_zero3_shards_inside_a_node_and_replicates_across_nodes():
    """Hybrid sharding on 2 nodes of 4: a dp_cp group's ranks on one node hold the slices, the
    ranks at the same place on each node the same slice; unsharded, the group itself."""
    node = ParallelConfig(tp=2, zero_stage=3, zero3_shard="node", ranks_per_node=4)  # dp 4
    assert groups_of(node, 8, "dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups_of(node, 8, "dp_cp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups_of(node, 8, "dp_cp_replica") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    every = ParallelConfig(tp=2, zero_stage=3)
    assert groups_of(every, 8, "dp_cp_shard") == groups_of(every, 8, "dp_cp")
    assert groups_of(every, 8, "edp_replica") == [[r] for r in range(8)]
    with pytest.raises(ValueError, match="sit unevenly on nodes of 3 ranks"):
        rank_grid(ParallelConfig(zero3_shard="node", ranks_per_node=3), 4)


def test_hybrid_cp_ulysses_inside_ring_across():
    config = ParallelConfig(cp=4, cp_algo="hybrid", ulysses_degree=2)
    assert groups_of(config, 4, "cp_ulysses") == [[0, 1], [2, 3]]
    assert groups_of(config, 4, "cp_ring") == [[0, 2], [1, 3]]
    assert (config.ulysses_size, config.ring_size) == (2, 2)
    ulysses = ParallelConfig(cp=4)
    assert groups_of(ulysses, 4, "cp_ulysses") == [[0, 1, 2, 3]]
    assert groups_of(ulysses, 4, "cp_ring") == [[0], [1], [2], [3]]
    ring = ParallelConfig(cp=4, cp_algo="ring")
    assert groups_of(ring, 4, "cp_ring") == [[0, 1, 2, 3]]


@pytest.mark.parametrize(
    "kwargs,world,rule",
    [
        (dict(tp=3), 4, "not divisible by tp\\*cp\\*pp"),
        (dict(tp=2, pp=2), 6, "not divisible"),
        (dict(vpp=2), 2, "vpp=2 needs pipeline parallelism"),
        (dict(ep=3), 4, "ep=3 must divide dp\\*cp"),
        (dict(cp_algo="zigzag"), 1, "cp_algo='zigzag' is unknown"),
        (dict(cp=4, cp_algo="hybrid"), 4, "needs ulysses_degree"),
        (dict(cp=4, cp_algo="hybrid", ulysses_degree=3), 4, "must be a positive divisor of cp=4"),
        (dict(cp=2, ulysses_degree=2, cp_algo="ring"), 2, "applies only to cp_algo='hybrid'"),
        (dict(tp=0), 1, "tp must be a positive integer"),
        (dict(sequence_parallel=True), 1, "needs tp > 1"),
        (dict(zero_stage=4), 1, "zero_stage=4 is unknown; use 0, 1, 2 or 3"),
        (dict(pp=2, pp_layers=[3]), 2, "pp_layers must be a list of 2 layer counts"),
        (dict(pp=2, pp_layers=[3, 0]), 2, "each at least 1"),
        (dict(pp=2, vpp=2, pp_layers=[3, 1]), 2, "must be 2 lists of 2 counts"),
    ],
)
def test_invalid_layouts_name_the_rule(kwargs, world, rule):
    with pytest.raises(ValueError, match=rule):
        ParallelConfig(**kwargs).data_parallel_size(world)


def test_an_uneven_split_is_kept_as_tuples_and_builds_the_stages_it_names():
    """parallel.pp_layers (YAML lists) becomes tuples, so a config stays hashable and equal after a
    JSON round trip; a model stage built without its own counts takes the topology's."""
    from mm_parallel.model_base import ParallelModel

    config = ParallelConfig(pp=2, vpp=2, pp_layers=[[1, 2], [2, 1]])
    assert config.pp_layers == ((1, 2), (2, 1)) and hash(config)
    assert ParallelConfig(pp=2, pp_layers=[5, 2]) == ParallelConfig(pp=2, pp_layers=(5, 2))
    stage = ParallelModel()
    layers = [stage.build_stage(Topology.build(config, 2, 1), chunk, 6) for chunk in (0, 1)]
    assert layers == [range(1, 3), range(5, 6)]  # virtual stages 1 and 3 of [1, 2 | 2, 1]


def test_world_of_one_needs_no_launcher_and_no_communication(monkeypatch):
    import mindspore as ms
    from mindspore import Tensor

    for var in ("MS_ROLE", "MS_WORKER_NUM", "RANK_TABLE_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(comm, "_BACKEND", None)
    topo = mm_parallel.initialize(ParallelConfig())
    assert (topo.world_size, topo.rank) == (1, 0)
    for kind in ("tp", "cp", "ep", "dp", "pp"):
        group = getattr(topo, kind)
        assert (group.size, group.rank, group.ranks) == (1, 0, (0,))
    x = Tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    for out in (
        comm.all_reduce(x, topo.tp),
        comm.all_gather(x, topo.cp, dim=1),
        comm.reduce_scatter(x, topo.dp),
        comm.all_to_all(x, topo.cp, 0, 1),
        comm.broadcast(x, 0, topo.world),
        comm.ring_shift(x, topo.cp),
        mappings.gather_from_sequence(x, topo.tp),
        mappings.copy_to_region(x),
    ):
        np.testing.assert_array_equal(out.asnumpy(), x.asnumpy())
    comm.barrier()
    grad = ms.grad(lambda t: (mappings.reduce_from_region(t) * 3).sum())(x)
    np.testing.assert_array_equal(grad.asnumpy(), np.full((2, 3), 3, np.float32))
    assert comm._BACKEND is None, "a world of one must not create a communication backend"
    assert mm_parallel.get_topology() is topo


def test_launched_process_must_initialize_first(monkeypatch):
    import mm_parallel.topology as topology

    monkeypatch.setenv("MS_ROLE", "MS_WORKER")
    monkeypatch.setattr(topology, "_DEFAULT", None)
    with pytest.raises(RuntimeError, match="initialize"):
        mm_parallel.get_topology()


def test_shape_checks_do_not_depend_on_the_group():
    from mindspore import Tensor

    topo = Topology.build(ParallelConfig(), 1, 0)
    with pytest.raises(ValueError, match="out of range"):
        comm.all_gather(Tensor(np.zeros((2, 2), np.float32)), topo.tp, dim=2)
    with pytest.raises(ValueError, match="is unknown"):
        comm.all_reduce(Tensor(np.zeros((2,), np.float32)), topo.tp, op="prod")
    with pytest.raises(TypeError, match="needs a floating dtype"):
        comm.all_reduce(Tensor(np.zeros((2,), np.int32)), topo.tp, op="avg")
    with pytest.raises(ValueError, match="not in the tp group"):
        comm.broadcast(Tensor(np.zeros((2,), np.float32)), 3, topo.tp)


def test_a_group_mindspore_failed_to_create_is_an_error_not_a_cached_empty_name(monkeypatch):
    """mint.distributed.new_group logs a failure and returns "" (which names no group); the backend
    raises instead of caching it, and a later call tries again."""
    import mindspore.mint.distributed as dist

    from mm_parallel.comm.cpu import CpuBackend
    from mm_parallel.topology import Group

    backend, calls = CpuBackend(), []
    backend._world_size = 4
    monkeypatch.setattr(dist, "new_group", lambda ranks, backend: calls.append(ranks) or "")
    with pytest.raises(RuntimeError, match=r"communication group of ranks \[0, 2\] failed"):
        backend.group_name(Group((0, 2), 0, "cp"))
    monkeypatch.setattr(dist, "new_group", lambda ranks, backend: calls.append(ranks) or "mccl_2_x")
    assert backend.group_name(Group((0, 2), 0, "cp")) == "mccl_2_x" and calls == [[0, 2], [0, 2]]
