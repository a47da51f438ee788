"""DistributedOptimizer and learning-rate schedules: one process equals a numpy AdamW written in
the test; dp2 with zero 0/1/2/3, cp2, tp2+sp, dp2 x tp2(+sp) (zero 3 too), dp2 x cp2 (zero 3
too) and dp4 equal one process (losses, grad norms, parameters after three steps); state saved
under one dp size / zero stage and reloaded under another continues exactly (ZeRO-1 <-> ZeRO-3
too); loss scaling; clear errors."""

import math

import numpy as np
import pytest
from helpers.optimizer_cases import CFG, B, batches, numpy_adamw, run_optimizer_cases, train
from helpers.reference_model import build_stack, run_stack

from mm_parallel import ParallelConfig
from mm_parallel.grad_buckets import Piece, cut_into_buckets, no_weight_decay
from mm_parallel.lr_schedule import LRSchedule
from mm_parallel.optimizer import DistributedOptimizer, OptimizerConfig
from mm_parallel.topology import Topology

SOLO = Topology.build(ParallelConfig(), 1, 0)


def test_lr_schedules():
    warm = LRSchedule(1.0, warmup_steps=4, decay_steps=10, style="cosine", min_lr=0.1)
    assert [warm(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert warm(4) == 1.0 and warm(9) == pytest.approx(0.55) and warm(14) == pytest.approx(0.1)
    assert warm(100) == pytest.approx(0.1)
    linear = LRSchedule(2.0, decay_steps=4, style="linear", min_lr=0.0)
    assert [linear(s) for s in range(6)] == [2.0, 1.5, 1.0, 0.5, 0.0, 0.0]
    assert LRSchedule(0.3)(1000) == 0.3
    with pytest.raises(ValueError, match="unknown"):
        LRSchedule(1.0, style="step")
    with pytest.raises(ValueError, match="decay_steps > 0"):
        LRSchedule(1.0, style="cosine")


def test_one_process_equals_numpy_adamw():
    import mindspore as ms
    from mindspore import Tensor

    losses, norms, params, _ = train(SOLO, 1, CFG, batches())
    stack = build_stack(SOLO)
    ps = stack.trainable_params()
    init = {p.name: p.asnumpy().copy() for p in ps}
    decayed = {p.name: not no_weight_decay(p.name, p) for p in ps}
    assert not decayed["0.norm1"] and not decayed["0.q.bias"] and decayed["0.q.weight"]
    current, grads_per_step = init, []
    for x, c in batches():  # the gradient at the numpy trajectory's parameters, step by step
        for p in ps:
            p.set_data(Tensor(current[p.name].astype(np.float32)))
        _, grads = ms.value_and_grad(lambda t: (run_stack(stack, t) * Tensor(c)).sum() / B, None, ps)(Tensor(x))
        grads_per_step.append({p.name: g.asnumpy() for p, g in zip(ps, grads)})
        current, want_norms = numpy_adamw(init, grads_per_step, decayed, CFG)
    assert want_norms[0] > CFG["clip_grad"]  # clipping is exercised
    np.testing.assert_allclose(norms, want_norms, rtol=1e-5)
    for name, want in current.items():
        np.testing.assert_allclose(params[name], want, rtol=1e-4, atol=1e-6, err_msg=name)


def test_loss_scaling():
    from mindspore import Tensor

    stack = build_stack(SOLO, layers=1)
    grads = [Tensor(np.ones(p.shape, np.float32)) for p in stack.trainable_params()]
    bad = [Tensor(np.full(p.shape, np.inf, np.float32)) for p in stack.trainable_params()]
    config = OptimizerConfig(dynamic_loss_scale=True, initial_loss_scale=8.0, loss_scale_window=2, clip_grad=0)
    opt = DistributedOptimizer(stack, config, SOLO)
    before = {p.name: p.asnumpy().copy() for p in stack.trainable_params()}
    info = opt.step(bad)
    assert info["skipped"] and info["loss_scale"] == 4.0 and opt.step_count == 0
    assert all(np.array_equal(p.asnumpy(), before[p.name]) for p in stack.trainable_params())
    assert float(opt.scale_loss(Tensor(1.5)).asnumpy()) == 6.0
    opt.step(grads), opt.step(grads)
    assert opt.loss_scale == 8.0 and opt.step_count == 2  # doubled after a window of good steps

    # a static scale divides the gradients back: same update as no scaling at all
    plain, scaled = build_stack(SOLO, layers=1), build_stack(SOLO, layers=1)
    DistributedOptimizer(plain, OptimizerConfig(clip_grad=0), SOLO).step(grads)
    DistributedOptimizer(scaled, OptimizerConfig(clip_grad=0, loss_scale=128.0), SOLO).step([g * 128 for g in grads])
    for a, b in zip(plain.trainable_params(), scaled.trainable_params()):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-6)


def test_optimizer_errors(tmp_path):
    stack = build_stack(SOLO, layers=1)
    with pytest.raises(ValueError, match="zero_stage must be 0, 1, 2 or 3"):
        DistributedOptimizer(stack, topology=SOLO, zero_stage=4)
    opt = DistributedOptimizer(stack, topology=SOLO)
    with pytest.raises(ValueError, match="gradients for"):
        opt.step([])
    with pytest.raises(FileNotFoundError, match="no optimizer-stage"):
        opt.load(str(tmp_path))
    opt.save(str(tmp_path))
    other = DistributedOptimizer(build_stack(SOLO, layers=2), topology=SOLO)
    with pytest.raises(KeyError, match="saved for other trainable parameters"):
        other.load(str(tmp_path))


def test_cut_into_buckets():
    cut = cut_into_buckets([5, 7, 9], [3, 10, 4], bucket_numel=5, shards=2)  # capacity 6
    assert cut == [[Piece(5, 0, 3, 3), Piece(7, 0, 3, 10)], [Piece(7, 3, 9, 10)],
                   [Piece(7, 9, 10, 10), Piece(9, 0, 4, 4)]]
    assert [sum(p.size for p in b) for b in cut] == [6, 6, 5]  # only the last one is short (padded)
    assert cut_into_buckets([0, 1], [3, 10], bucket_numel=0, shards=4) == [[Piece(0, 0, 3, 3), Piece(1, 0, 10, 10)]]
    big = cut_into_buckets([0], [25], bucket_numel=10, shards=1)  # a large parameter over three buckets
    assert [(p.lo, p.hi) for b in big for p in b] == [(0, 10), (10, 20), (20, 25)]


def test_small_buckets_equal_one_bucket(tmp_path):
    """Buckets that cut through parameters change nothing: steps, the saved state (loaded under
    the other bucketing) and state_bytes_of's count."""
    from mm_parallel.grad_buckets import state_bytes_of

    cut = dict(CFG, bucket_numel=333)
    want = train(SOLO, 1, CFG, batches(), save_dir=str(tmp_path / "one"))
    got = train(SOLO, 1, cut, batches(), save_dir=str(tmp_path / "cut"))
    assert len(got[3].buckets) > 10 and len(want[3].buckets) == 1
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
    for name, value in want[2].items():
        np.testing.assert_allclose(got[2][name], value, rtol=1e-6, atol=1e-7)
    for a, b in zip(got[3].param_states(), want[3].param_states()):
        for key in DistributedOptimizer.STATES:
            np.testing.assert_allclose(a[key], b[key], rtol=1e-6, atol=1e-7)
    data = batches()[2:]
    resumed = train(SOLO, 1, CFG, data, load_dir=str(tmp_path / "cut"))  # cut -> one bucket
    again = train(SOLO, 1, cut, data, load_dir=str(tmp_path / "one"))  # one bucket -> cut
    np.testing.assert_allclose(resumed[1], again[1], rtol=1e-6)
    for name, value in resumed[2].items():
        np.testing.assert_allclose(again[2][name], value, rtol=1e-6, atol=1e-7)
    params = build_stack(SOLO).trainable_params()
    assert state_bytes_of(params, SOLO, 1, 333) == got[3].state_bytes()


LAYOUTS = {
    2: {
        "dp2_zero0": {"layout": {}, "zero": 0},
        "dp2_zero1": {"layout": {"zero_stage": 1}, "zero": 1},
        "dp2_zero2": {"layout": {"zero_stage": 2}, "zero": 2},
        "cp2_zero1": {"layout": {"cp": 2, "zero_stage": 1}, "zero": 1},
        "tp2_sp": {"layout": {"tp": 2, "sequence_parallel": True}, "zero": 1},
        # buckets of 1500 values (~5 here) that cut through parameters
        "dp2_zero1_buckets": {"layout": {"zero_stage": 1}, "zero": 1, "optim": {"bucket_numel": 1500}},
        "dp2_zero3": {"layout": {"zero_stage": 3}, "zero": 3},
        "dp2_zero3_kept": {"layout": {"zero_stage": 3, "reshard_after_forward": False}, "zero": 3},
        "dp2_zero3_offload": {"layout": {"zero_stage": 3}, "zero": 3, "optim": {"offload": "optimizer"}},
    },
    4: {
        "dp2_tp2_zero1": {"layout": {"tp": 2, "zero_stage": 1}, "zero": 1},
        "dp2_tp2_sp_zero2": {"layout": {"tp": 2, "sequence_parallel": True, "zero_stage": 2}, "zero": 2},
        "dp2_cp2_zero1": {"layout": {"cp": 2, "zero_stage": 1}, "zero": 1},
        "dp4_zero1": {"layout": {"zero_stage": 1}, "zero": 1},
        "dp2_tp2_resumed": {"layout": {"tp": 2, "zero_stage": 1}, "zero": 1, "resume": "dp2_tp2_zero1"},
        "dp4_zero1_from_dp2": {"layout": {"zero_stage": 1}, "zero": 1, "resume": "dp2_zero1"},  # saved by world 2
        "dp4_zero2_from_zero1": {"layout": {"zero_stage": 2}, "zero": 2, "resume": "dp4_zero1"},
        "dp4_zero0_from_dp2_cp2": {"layout": {}, "zero": 0, "resume": "dp2_cp2_zero1"},
        "dp2_tp2_sp_zero2_buckets": {"layout": {"tp": 2, "sequence_parallel": True, "zero_stage": 2}, "zero": 2,
                                     "optim": {"bucket_numel": 700}},
        "dp4_zero1_buckets_from_one_bucket": {"layout": {"zero_stage": 1}, "zero": 1, "resume": "dp4_zero1",
                                              "optim": {"bucket_numel": 999}},
        "dp4_zero0_from_buckets": {"layout": {}, "zero": 0, "resume": "dp2_zero1_buckets"},
        "dp2_tp2_sp_zero3": {"layout": {"tp": 2, "sequence_parallel": True, "zero_stage": 3}, "zero": 3},
        "dp2_cp2_zero3": {"layout": {"cp": 2, "zero_stage": 3}, "zero": 3},
        "dp4_zero3_from_dp2_zero1": {"layout": {"zero_stage": 3}, "zero": 3, "resume": "dp2_zero1"},
        "dp4_zero1_from_dp2_zero3": {"layout": {"zero_stage": 1}, "zero": 1, "resume": "dp2_zero3"},
        # hybrid sharding: two "nodes" of two ranks, each weight cut in halves held on both nodes
        "dp4_zero3_node": {"layout": {"zero_stage": 3, "zero3_shard": "node", "ranks_per_node": 2}, "zero": 3},
    },
}


@pytest.fixture(scope="module")
def save_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("optimizer_state"))


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])  # in this order: world 4 reloads what world 2 saved
def test_distributed_optimizer_equals_single_process(run_distributed, save_root, world):
    results = run_distributed(run_optimizer_cases, nproc=world, timeout=600, layouts=LAYOUTS[world],
                              save_root=save_root)
    for rank, result in enumerate(results):
        assert set(result) == set(LAYOUTS[world])
        failed = {case: p for case, p in result.items() if p}
        assert not failed, (rank, failed)


def test_schedule_follows_steps_in_the_optimizer():
    stack = build_stack(SOLO, layers=1)
    config = OptimizerConfig(lr=1.0, warmup_steps=2, decay_steps=2, lr_schedule="cosine", min_lr=0.0)
    opt = DistributedOptimizer(stack, config, SOLO)
    from mindspore import Tensor

    grads = [Tensor(np.ones(p.shape, np.float32)) for p in stack.trainable_params()]
    lrs = [opt.step(grads)["lr"] for _ in range(5)]
    assert lrs == pytest.approx([0.5, 1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 2)), 0.0])


def test_step_buffer_values_count_what_the_buckets_hold():
    """Parameters of 3, 10 and 4 values, buckets of 5 (6 under dp 2): [3 + 3], [6], [1 + 4 + pad 1]."""
    from mindspore import Parameter, Tensor, nn

    from mm_parallel.grad_buckets import step_buffer_values

    class Three(nn.Cell):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = (Parameter(Tensor(np.zeros(n, np.float32)), name=k) for k, n in
                                      (("a", 3), ("b", 10), ("c", 4)))

    params = Three().trainable_params()
    dp2 = Topology.build(ParallelConfig(zero_stage=1), 2, 0)
    # kept: this rank's half of each bucket, 3 x 3; transients 2 x 6; the cut parameter b: 10
    assert step_buffer_values(params, dp2, 1, bucket_numel=5) == 2 * 6 + max(9, 10)
    # without ZeRO buckets of 5: [a + b[:2]], [b[2:7]], [b[7:] + c[:2]], [c[2:]], each kept whole
    assert step_buffer_values(params, dp2, 0, bucket_numel=5) == 2 * 5 + (5 + 5 + 5 + 2)
    # one process: b[2:7] and c[2:] are views of their gradients, not copies
    assert step_buffer_values(params, SOLO, 0, bucket_numel=5) == 2 * 5 + max(5 + 5, 10)
    assert step_buffer_values(params, SOLO, 0, bucket_numel=10) == 2 * 10 + max(10 + 7, 10)
    assert step_buffer_values(params, SOLO, 0, bucket_numel=0) == 2 * 17 + 17  # one bucket, nothing cut


def _steps_on_both_paths(config, grad_sequence, finite_losses=None):
    """Parameters and step figures after each step of ``grad_sequence`` (lists of numpy arrays),
    on the host path and on the device path (stand-ins); the device path's reads are counted."""
    from mindspore import Tensor

    from mm_parallel.testing.device_path import ascend_stand_ins
    from mm_parallel.testing.host_transfers import host_transfers

    out = {}
    for path in ("host", "device"):
        stack = build_stack(SOLO, layers=1)
        opt = DistributedOptimizer(stack, config, SOLO)
        params, infos, reads = [], [], 0
        for k, grads in enumerate(grad_sequence):
            grads = [Tensor(g) for g in grads]
            finite = None if finite_losses is None else finite_losses[k]
            if path == "host" and finite is False:  # what mm-train's loop does with a non-finite loss there
                info, opt.iteration = None, opt.iteration + 1
            elif path == "host":
                info = opt.step(grads)
            else:
                with ascend_stand_ins(), host_transfers() as seen:
                    info = opt.step(grads, finite_loss=None if finite is None else Tensor(np.array([finite])))
                reads += seen.reads
                info = {key: v if isinstance(v, (int, float)) else v.asnumpy()[0] for key, v in info.items()}
            params.append([p.asnumpy().copy() for p in stack.trainable_params()])
            infos.append(info)
        out[path] = params, infos, opt.counters(), reads
    return out


def test_the_device_path_step_equals_the_host_step_and_reads_nothing():
    """Clipped steps, a non-finite gradient (also as the very first step, where the device's
    bias correction divides by 1 - b1^0 = 0 and must not leak), a non-finite loss and weight
    decay with undecayed norms and biases: the device path's weights equal the host path's and
    the step reads the host not once."""
    stack = build_stack(SOLO, layers=1)
    rng = np.random.default_rng(0)
    good = lambda scale: [rng.standard_normal(p.shape).astype(np.float32) * scale  # noqa: E731
                          for p in stack.trainable_params()]
    bad = [np.full(p.shape, np.nan, np.float32) for p in stack.trainable_params()]
    bad[0][..., 0] = np.inf
    sequence = [bad, good(3.0), good(0.01), bad, good(3.0), good(0.01)]
    config = OptimizerConfig(lr=1e-2, clip_grad=1.0, weight_decay=0.1)
    both = _steps_on_both_paths(config, sequence, finite_losses=[None, None, None, None, False, None])
    (host, host_info, host_counters, _), (device, device_info, device_counters, reads) = both["host"], both["device"]
    assert reads == 0
    assert [bool(i["skipped"]) for i in device_info] == [True, False, False, True, True, False]
    assert host_counters == device_counters == {"step_count": 3, "iteration": 6, "loss_scale": 1.0, "good_steps": 0}
    for step, (want, got) in enumerate(zip(host, device)):
        for a, b in zip(want, got):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=f"step {step + 1}")
    for want, got in zip(host_info, device_info):
        if want is not None and np.isfinite(want["grad_norm"]):
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6)
    assert not np.array_equal(device[1][0], device[0][0]) and np.array_equal(device[3][0], device[2][0])


def test_dynamic_loss_scaling_on_the_device_path_equals_the_host():
    stack = build_stack(SOLO, layers=1)
    ones = [np.ones(p.shape, np.float32) for p in stack.trainable_params()]
    inf = [np.full(p.shape, np.inf, np.float32) for p in stack.trainable_params()]
    config = OptimizerConfig(dynamic_loss_scale=True, initial_loss_scale=8.0, loss_scale_window=2, clip_grad=0)
    both = _steps_on_both_paths(config, [inf, ones, ones, ones, inf, ones])
    (host, host_info, host_counters, _), (device, device_info, device_counters, reads) = both["host"], both["device"]
    assert reads == 0 and host_counters == device_counters
    assert [i["loss_scale"] for i in device_info] == [i["loss_scale"] for i in host_info] == [4, 4, 8, 8, 4, 4]
    assert [bool(i["overflow"]) for i in device_info] == [i["overflow"] for i in host_info]
    for want, got in zip(host, device):
        for a, b in zip(want, got):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bucket_numel", [0, 333])
def test_offloaded_state_updates_bit_for_bit_like_the_resident_one(bucket_numel):
    """optim.offload: optimizer keeps master weights and moments in host memory and streams each
    bucket's through the same fused update: weights, moments and step figures equal the resident
    run's bit for bit, on the host path and the device path's stand-ins; the device holds none of
    the state between steps, the host all of it."""
    import dataclasses

    stack = build_stack(SOLO, layers=1)
    rng = np.random.default_rng(3)
    grads = [[rng.standard_normal(p.shape).astype(np.float32) for p in stack.trainable_params()] for _ in range(3)]
    resident = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.5, bucket_numel=bucket_numel)
    offloaded = dataclasses.replace(resident, offload="optimizer")
    want, got = _steps_on_both_paths(resident, grads), _steps_on_both_paths(offloaded, grads)
    for path in ("host", "device"):
        for step, (a, b) in enumerate(zip(want[path][0], got[path][0])):
            assert all(np.array_equal(x, y) for x, y in zip(a, b)), (path, step)
        assert want[path][1] == got[path][1] and want[path][2] == got[path][2], path
    opt = DistributedOptimizer(stack, offloaded, SOLO)
    on_device = DistributedOptimizer(build_stack(SOLO, layers=1), resident, SOLO)
    assert opt.state_bytes() == 0 and opt.host_state_bytes() == on_device.state_bytes() > 0
    from mindspore import Tensor

    opt.step([Tensor(g) for g in grads[0]])
    on_device.step([Tensor(g) for g in grads[0]])
    for a, b in zip(opt.param_states(), on_device.param_states()):
        assert all(np.array_equal(a[key], b[key]) for key in DistributedOptimizer.STATES)
    with pytest.raises(ValueError, match="optim.offload='activations' is unknown; use optimizer"):
        dataclasses.replace(resident, offload="activations")
