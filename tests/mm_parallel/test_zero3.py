"""mm_parallel.zero3's regions on two processes: a model whose embedding and linear weights are cut
into flat slices computes what the whole model computes, and each slice's gradient is that slice
of the sum over the ranks of the whole weights' gradients (the rest: each rank's own) — fp32 and
bf16 (emulated: W rounded before the matmul, each rank's dW rounded before the sum); gathers are
counted; gathered slices give back the whole weights; a frozen weight is cut too and gets no
gradient; on the Ascend path's stand-ins too (the native backend's HCCL calls)."""

import numpy as np
import pytest

pytestmark = pytest.mark.distributed


def _model(topo):
    from mindspore import nn

    from mm_parallel.blocks import Linear
    from mm_parallel.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding, seed_parameters

    seed_parameters(5)

    class Model(nn.Cell):
        def __init__(self):
            super().__init__()
            self.embed = VocabParallelEmbedding(64, 16, topology=topo)
            self.up = ColumnParallelLinear(16, 33, topology=topo)  # 528 values: padded to a multiple of 2
            self.down = Linear(33, 16, bias=False)

        def construct(self, ids):
            return self.down(self.up(self.embed(ids)))

    return Model()


def regions_equal_the_whole_model(precision_name, device_path):
    """Runs on every rank: [problems]; ``device_path``: on the Ascend path's stand-ins (fused
    kernels, the native backend's HCCL calls), which must carry the gathers and reduce-scatters."""
    import contextlib

    import mm_parallel
    from mm_parallel import ParallelConfig
    from mm_parallel.testing import device_path as stand_ins

    topo = mm_parallel.initialize(ParallelConfig(zero_stage=3))
    with stand_ins.ascend_stand_ins() if device_path else contextlib.nullcontext():
        problems = _compare(topo, precision_name)
        if device_path and not {"all_gather_into_tensor", "reduce_scatter_tensor"} <= set(stand_ins.CALLS):
            problems.append(f"the stand-ins saw {sorted(set(stand_ins.CALLS))}, not the gathers and reduce-scatters")
    return problems


def _compare(topo, precision_name):
    import mindspore as ms
    from mindspore import Tensor

    from mm_parallel import comm, precision
    from mm_parallel.ops.device import as_type
    from mm_parallel.sharding import sharding_of
    from mm_parallel.zero3 import GATHERS, shard_parameters

    policy = precision.Precision(precision_name)
    ids = Tensor(np.random.default_rng(topo.rank).integers(0, 64, (2, 5)).astype(np.int32))
    problems = []
    try:
        whole, sharded = _model(topo), _model(topo)
        for model in (whole, sharded):
            precision.apply(model, policy)
            model.up.bias.requires_grad = False  # a frozen parameter left whole
            model.down.weight.requires_grad = False  # a frozen weight: cut too, its backward dX alone
        done = shard_parameters(sharded, topo, min_numel=1)
        if done.sharded != 3 or sharding_of(sharded.down.weight).flat_over is None or sharded.down.weight.requires_grad:
            problems.append(f"{done} sharded, expected the embedding and both linears, down frozen")
        GATHERS.clear()

        def run(model):
            params = model.trainable_params()
            out, grads = ms.value_and_grad(lambda t: (as_type(model(t), ms.float32) ** 2).sum(), None, params)(ids)
            return out, {p.name: g for p, g in zip(params, grads)}

        loss_whole, grads_whole = run(whole)
        loss_sharded, grads_sharded = run(sharded)
        if dict(GATHERS) != {"forward": 3, "backward": 2}:  # the embedding's backward needs no gather
            problems.append(f"gathers {dict(GATHERS)}")
        if float(loss_whole.asnumpy()) != float(loss_sharded.asnumpy()):
            problems.append(f"loss {loss_sharded} != {loss_whole}")
        for p in sharded.trainable_params():
            spec = sharding_of(p)
            local = as_type(grads_whole[p.name], ms.float32)  # a whole parameter's: this rank's, reduced later
            want = (spec.flat_slice(comm.all_reduce(local, topo.dp).asnumpy(), topo) if spec.flat_over
                    else local.asnumpy())
            got = as_type(grads_sharded[p.name], ms.float32).asnumpy()
            if got.shape != want.shape or not np.allclose(got, want, rtol=1e-6, atol=1e-7):
                problems.append(f"{p.name}: gradient {got.shape} differs from the whole model's slice {want.shape}")
            if spec.flat_over:  # the slice round-trips: gathered it is the whole weight's value
                full = spec.gather(p, topo).asnumpy()
                weight = dict((q.name, q) for q in whole.trainable_params())[p.name]
                if not np.array_equal(as_type(Tensor(full), weight.dtype).astype(ms.float32).asnumpy(),
                                      as_type(weight, ms.float32).asnumpy()):
                    problems.append(f"{p.name}: gathered slices differ from the whole weight")
    finally:
        precision.activate(precision.Precision())
    return problems


@pytest.mark.parametrize("precision_name, device_path", [("fp32", False), ("bf16", False), ("fp32", True)])
def test_sharded_weights_compute_and_reduce_like_whole_ones(run_distributed, precision_name, device_path):
    results = run_distributed(regions_equal_the_whole_model, nproc=2, timeout=300, precision_name=precision_name,
                              device_path=device_path)
    assert results == [[], []], results


def experts_equal_whole_ones(precision_name, device_path):
    """Runs on every rank: [problems]. MoE experts' fused tensors cut over expert-dp (ep 1: the dp
    group) compute what whole ones compute — the padded block's batched matmuls on CPU, Ascend's
    grouped matmul on the stand-ins — and each slice's gradient is the slice of the ranks' summed
    whole gradients."""
    import contextlib

    import mindspore as ms
    from mindspore import Tensor

    import mm_parallel
    from mm_parallel import ParallelConfig, comm, precision
    from mm_parallel.moe.experts import GroupedExperts
    from mm_parallel.moe.token_layout import expert_groups
    from mm_parallel.ops.device import as_type
    from mm_parallel.sharding import sharding_of
    from mm_parallel.tensor_parallel import seed_parameters
    from mm_parallel.testing import device_path as stand_ins
    from mm_parallel.zero3 import GATHERS, shard_parameters

    topo = mm_parallel.initialize(ParallelConfig(zero_stage=3))
    problems = []
    rng = np.random.default_rng(10 + topo.rank)
    tokens = Tensor(np.concatenate([rng.normal(size=(7, 8)), np.zeros((1, 8))]).astype(np.float32))
    groups = expert_groups(np.array([2, 0, 2, 2, -1, 0, 2]), 3, 7)  # expert 1 gets no row
    try:
        with stand_ins.ascend_stand_ins() if device_path else contextlib.nullcontext():
            models = []
            for _ in range(2):
                seed_parameters(3)
                models.append(GroupedExperts(3, 8, 5, topology=topo))
                precision.apply(models[-1], precision.Precision(precision_name))
            whole, sharded = models
            done = shard_parameters(sharded, topo, min_numel=1)
            if done.sharded != 2 or sharding_of(sharded.down_proj).flat_over != "edp":
                problems.append(f"{done}: expected both expert tensors cut over edp")
            GATHERS.clear()

            def run(model):
                params = model.trainable_params()
                loss = lambda t: (as_type(model(t, groups), ms.float32) ** 2).sum()  # noqa: E731
                out, grads = ms.value_and_grad(loss, None, params)(tokens)
                return out, {p.name: g for p, g in zip(params, grads)}

            loss_whole, grads_whole = run(whole)
            loss_sharded, grads_sharded = run(sharded)
            if device_path and "grouped_matmul" not in stand_ins.CALLS:
                problems.append("the grouped matmul stand-in was not called")
        if dict(GATHERS) != {"forward": 2, "backward": 2}:
            problems.append(f"gathers {dict(GATHERS)}")
        if not np.allclose(loss_whole.asnumpy(), loss_sharded.asnumpy(), rtol=1e-6):
            problems.append(f"loss {loss_sharded} != {loss_whole}")
        for p in sharded.trainable_params():
            want = sharding_of(p).flat_slice(comm.all_reduce(as_type(grads_whole[p.name], ms.float32),
                                                             topo.dp).asnumpy(), topo)
            got = as_type(grads_sharded[p.name], ms.float32).asnumpy()
            if got.shape != want.shape or not np.allclose(got, want, rtol=1e-5, atol=1e-6):
                problems.append(f"{p.name}: gradient differs from the whole experts' slice "
                                f"(max {np.abs(got - want).max() if got.shape == want.shape else got.shape})")
    finally:
        precision.activate(precision.Precision())
    return problems


@pytest.mark.parametrize("precision_name, device_path", [("fp32", False), ("bf16", False), ("bf16", True)])
def test_sharded_experts_compute_and_reduce_like_whole_ones(run_distributed, precision_name, device_path):
    results = run_distributed(experts_equal_whole_ones, nproc=2, timeout=300, precision_name=precision_name,
                              device_path=device_path)
    assert results == [[], []], results
