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

    from mm_parallel import precision
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
        problems += _gradient_problems(sharded.trainable_params(), grads_whole, grads_sharded, topo, 1e-6, 1e-7)
        for p in sharded.trainable_params():
            spec = sharding_of(p)
            if spec.flat_over:  # the slice round-trips: gathered it is the whole weight's value
                full = spec.gather(p, topo).asnumpy()
                weight = dict((q.name, q) for q in whole.trainable_params())[p.name]
                if not np.array_equal(as_type(Tensor(full), weight.dtype).astype(ms.float32).asnumpy(),
                                      as_type(weight, ms.float32).asnumpy()):
                    problems.append(f"{p.name}: gathered slices differ from the whole weight")
    finally:
        precision.activate(precision.Precision())
    return problems


def _gradient_problems(params, grads_whole, grads_sharded, topo, rtol, atol):
    """Each parameter's gradient against the whole model's: a slice's is that slice of the ranks'
    summed whole gradients, a whole parameter's this rank's own (reduced later)."""
    import mindspore as ms

    from mm_parallel import comm
    from mm_parallel.ops.device import as_type
    from mm_parallel.sharding import sharding_of

    problems = []
    for p in params:
        spec, local = sharding_of(p), as_type(grads_whole[p.name], ms.float32)
        want = spec.flat_slice(comm.all_reduce(local, topo.dp).asnumpy(), topo) if spec.flat_over else local.asnumpy()
        got = as_type(grads_sharded[p.name], ms.float32).asnumpy()
        if got.shape != want.shape or not np.allclose(got, want, rtol=rtol, atol=atol):
            problems.append(f"{p.name}: gradient {got.shape} differs from the whole model's {want.shape} "
                            f"(max {np.abs(got - want).max() if got.shape == want.shape else '-'})")
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
    from mm_parallel import ParallelConfig, precision
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
        problems += _gradient_problems(sharded.trainable_params(), grads_whole, grads_sharded, topo, 1e-5, 1e-6)
    finally:
        precision.activate(precision.Precision())
    return problems


@pytest.mark.parametrize("precision_name, device_path", [("fp32", False), ("bf16", False), ("bf16", True)])
def test_sharded_experts_compute_and_reduce_like_whole_ones(run_distributed, precision_name, device_path):
    results = run_distributed(experts_equal_whole_ones, nproc=2, timeout=300, precision_name=precision_name,
                              device_path=device_path)
    assert results == [[], []], results


def prefetched_steps_equal_unprefetched(steps):
    """Runs on every rank: [problems]. Three steps of a two-layer model on the Ascend path's
    stand-ins, whose asynchronous gather delivers its output only at the handle's wait (NaN
    before): from the second step each weight's gather is begun during the layer before
    (prefetched), the losses and gradients equal those of the CPU path, which prefetches nothing,
    and the gathers per step stay weights x (forward + backward), less the last layer's, kept
    from its forward for its backward."""
    import mindspore as ms
    from mindspore import Tensor

    import mm_parallel
    from mm_parallel import ParallelConfig, zero3
    from mm_parallel.ops.device import as_type
    from mm_parallel.testing import device_path as stand_ins
    from mm_parallel.testing import hccl
    from mm_parallel.zero3_prefetch import PREFETCHED

    topo = mm_parallel.initialize(ParallelConfig(zero_stage=3))
    ids = Tensor(np.random.default_rng(topo.rank).integers(0, 64, (2, 5)).astype(np.int32))
    problems, runs = [], {}
    for path in ("cpu", "device"):
        model = _model(topo)
        zero3.shard_parameters(model, topo, min_numel=1)
        params = model.trainable_params()
        zero3.GATHERS.clear()
        PREFETCHED.clear()
        grad = ms.value_and_grad(lambda t: (as_type(model(t), ms.float32) ** 2).sum(), None, params)
        runs[path] = []
        for _ in range(steps):
            if path == "device":
                with stand_ins.ascend_stand_ins():
                    loss, grads = grad(ids)
            else:
                loss, grads = grad(ids)
            zero3.release()  # the step's end, as the optimizer's step does
            runs[path].append([float(loss.asnumpy())] + [g.asnumpy() for g in grads])
        # a step's uses: the embedding, up and down forward, down and up backward; prefetched, the
        # last layer's weight is kept from its forward for its backward (one gather fewer)
        kept = steps - 1 if path == "device" else 0
        if dict(zero3.GATHERS) != {"forward": 3 * steps, "backward": 2 * steps - kept}:
            problems.append(f"{path}: gathers {dict(zero3.GATHERS)} over {steps} steps")
        if path == "device" and dict(PREFETCHED) != {"forward": 2 * kept, "backward": kept, "reused": kept}:
            # each step after the first: every use but the step's first begun ahead
            problems.append(f"prefetched {dict(PREFETCHED)}")
    if hccl.unwaited():
        problems.append(f"{hccl.unwaited()} asynchronous gathers never waited on")
    out = Tensor(np.zeros(4, np.float32))  # the stand-in itself: a read before the wait sees NaN
    handle = hccl.all_gather_into_tensor(out, Tensor(np.full(2, topo.rank, np.float32)), async_op=True)
    before = out.asnumpy().copy()
    handle.wait()
    if not np.isnan(before).all() or out.asnumpy().tolist() != [0, 0, 1, 1]:
        problems.append(f"the asynchronous stand-in gave {before} before its wait, {out} after")
    for step, (cpu, device) in enumerate(zip(runs["cpu"], runs["device"])):
        if cpu[0] != device[0] or not all(np.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(cpu[1:], device[1:])):
            problems.append(f"step {step}: the prefetched step differs (loss {device[0]} vs {cpu[0]})")
    return problems


def test_prefetched_gathers_change_nothing_but_when_they_start(run_distributed):
    results = run_distributed(prefetched_steps_equal_unprefetched, nproc=2, timeout=300, steps=3)
    assert results == [[], []], results
