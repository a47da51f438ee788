"""Pipeline parallel: stage cutting (even, uneven, VPP lists, clear errors); gradient accumulation
over micro-batches equals one batch that many times larger; the interleaved schedule is complete
and never stalls; 1F1B under pp2 (even, uneven, varying sequence lengths), pp4 (even, uneven) and
pp2 x tp2, and the interleaved schedule under pp2 x vpp2 (even, uneven), pp4 x vpp2 and pp2 x vpp2 x tp2, and stages
that pass dicts of float32 / bfloat16 / int64 tensors of varying shapes under pp2, pp4 and pp2 x vpp2: three
DistributedOptimizer steps equal one process (per-micro-batch losses and global norm each step,
first-step gradients, final parameters)."""

import numpy as np
import pytest
from helpers.pipeline_cases import run_pipeline_cases

from mm_parallel.pipeline import stage_layer_ranges


def test_stage_layer_ranges():
    assert stage_layer_ranges(8, 2) == [[range(0, 4), range(4, 8)]]
    assert stage_layer_ranges(7, 2, pipeline_num_layers=[5, 2]) == [[range(0, 5), range(5, 7)]]
    # VPP: chunk c of stage s is virtual stage c * pp + s
    assert stage_layer_ranges(8, 2, vpp=2) == [[range(0, 2), range(2, 4)], [range(4, 6), range(6, 8)]]
    assert stage_layer_ranges(6, 2, 2, [[2, 1], [1, 2]]) == [[range(0, 2), range(2, 3)], [range(3, 4), range(4, 6)]]


@pytest.mark.parametrize("args, message", [
    ((7, 2), "cannot be cut evenly"),
    ((8, 2, 2, None), None),
    ((7, 2, 1, [5, 1]), "sums to 6"),
    ((7, 2, 1, [7, 0]), "at least one layer"),
    ((7, 3, 1, [5, 2]), "list of 3 counts"),
    ((8, 2, 2, [4, 4]), "2 lists of 2 counts"),
])
def test_stage_layer_errors(args, message):
    if message is None:
        stage_layer_ranges(*args)
        return
    with pytest.raises(ValueError, match=message):
        stage_layer_ranges(*args)


@pytest.mark.parametrize("p, v, m", [(2, 2, 2), (2, 2, 4), (2, 3, 4), (4, 2, 4), (4, 2, 8), (4, 4, 8)])
def test_interleaved_schedule_runs_every_op_once(p, v, m):
    from mm_parallel.pipeline import interleaved_ticks

    ticks = interleaved_ticks(p, v, m)
    for s in range(p):
        ops = [row[s] for row in ticks if row[s] is not None]
        assert sorted(ops) == sorted((k, c, i) for k in "FB" for c in range(v) for i in range(m))
    # the bubble shrinks with v as theory says: within one tick per op of (p - 1) / (m + p - 1) / v
    assert 1 - 2 * m * v / len(ticks) <= (p - 1) / (m + p - 1) / v + (p - 1) / len(ticks)


def test_interleaved_needs_micro_batches_in_multiples_of_pp():
    from mm_parallel import ParallelConfig
    from mm_parallel.pipeline import train_step_interleaved
    from mm_parallel.topology import Topology

    topo = Topology.build(ParallelConfig(pp=2, vpp=2), 2, 0)
    with pytest.raises(ValueError, match="divisible by pp=2"):
        train_step_interleaved([abs, abs], [[], []], [(0, 0)] * 3, None, topo)


def test_accumulation_equals_one_larger_batch():
    import mindspore as ms
    from helpers.pipeline_cases import loss_fn, micro_batches
    from helpers.reference_model import build_stack, run_stack
    from mindspore import ops

    from mm_parallel import ParallelConfig
    from mm_parallel.pipeline import train_step_1f1b
    from mm_parallel.topology import Topology

    solo = Topology.build(ParallelConfig(), 1, 0)
    stack = build_stack(solo)
    params = stack.trainable_params()
    data = micro_batches(vary=False)
    losses, grads = train_step_1f1b(lambda t: run_stack(stack, t), params, data, loss_fn, solo)
    x, c = (ops.concat([d[i] for d in data], 0) for i in (0, 1))
    big_loss, big_grads = ms.value_and_grad(lambda t: loss_fn(run_stack(stack, t), c) / len(data), None, params)(x)
    np.testing.assert_allclose(np.mean(losses), float(big_loss.asnumpy()), rtol=1e-5)
    for p, g, want in zip(params, grads, big_grads):
        np.testing.assert_allclose(g.asnumpy(), want.asnumpy(), rtol=1e-4, atol=1e-6, err_msg=p.name)


LAYOUTS = {
    2: {
        "pp2": {"layout": {"pp": 2}},
        "pp2_uneven_varying_lengths": {"layout": {"pp": 2}, "pipeline_num_layers": [3, 1], "vary": True},
        "pp2_vpp2_varying_lengths": {"layout": {"pp": 2, "vpp": 2}, "vpp": 2, "vary": True, "plan": True},
        "pp2_vpp2_uneven": {"layout": {"pp": 2, "vpp": 2}, "vpp": 2, "layers": 6,
                            "pipeline_num_layers": [[1, 2], [2, 1]]},
        "pp2_dict_io_varying_lengths": {"layout": {"pp": 2}, "vary": True, "dict_io": True, "plan": True},
    },
    4: {
        "pp4_varying_lengths": {"layout": {"pp": 4}, "vary": True, "plan": True},
        "pp4_uneven": {"layout": {"pp": 4}, "layers": 5, "pipeline_num_layers": [1, 2, 1, 1]},
        "pp2_tp2_uneven": {"layout": {"pp": 2, "tp": 2}, "pipeline_num_layers": [1, 3]},
        "pp4_vpp2_varying_lengths": {"layout": {"pp": 4, "vpp": 2}, "vpp": 2, "layers": 8, "vary": True,
                                     "plan": True},
        "pp2_vpp2_tp2": {"layout": {"pp": 2, "vpp": 2, "tp": 2}, "vpp": 2},
        "pp4_dict_io_varying_lengths": {"layout": {"pp": 4}, "vary": True, "dict_io": True},
        "pp2_vpp2_dict_io_varying_lengths": {"layout": {"pp": 2, "vpp": 2}, "vpp": 2, "vary": True, "dict_io": True,
                                             "plan": True},
    },
}


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_equals_single_process(run_distributed, world):
    results = run_distributed(run_pipeline_cases, nproc=world, timeout=600, layouts=LAYOUTS[world])
    for rank, result in enumerate(results):
        assert set(result) == set(LAYOUTS[world])
        failed = {case: p for case, p in result.items() if p}
        assert not failed, (rank, failed)


def test_a_transfer_plan_keeps_headers_by_key_and_refuses_a_stage_that_breaks_its_contract():
    import mindspore as ms
    from mindspore import Tensor

    from mm_parallel.stage_io import TransferPlan, batch_shapes

    batch = {"ids": np.zeros((2, 8), np.int64), "pixels": [np.zeros((16, 3), np.float32)], "n": 3}
    assert batch_shapes(batch) == batch_shapes({**batch, "ids": np.ones((2, 8), np.int64)})
    assert batch_shapes(batch) != batch_shapes({**batch, "ids": np.zeros((2, 9), np.int64)})
    plan = TransferPlan()
    value = {"hidden": Tensor(np.zeros((2, 8, 4), np.float32)), "mask": Tensor(np.ones((2, 8)), ms.bool_)}
    assert plan.outgoing("k", value) is None and plan.handshakes == 1  # the first time: the header goes
    assert plan.outgoing("k", value)["tensors"][0] == ["hidden", "float32", [2, 8, 4]] and plan.handshakes == 1
    with pytest.raises(RuntimeError, match=r"hidden float32 \(2, 9, 4\).*micro-batch's shapes"):
        plan.outgoing("k", {**value, "hidden": Tensor(np.zeros((2, 9, 4), np.float32))})
