"""Mixed precision: the bf16 rounding the CPU emulation uses equals a numpy round-to-nearest-even
written here; an emulated bf16 linear equals numpy's round(round(x) @ W) and rounds its gradients;
parameters are cast except the modules kept in fp32 and marked parameters; the policy's settings and errors;
the device branch (casts on Ascend); a bf16 stack trains through the DistributedOptimizer with fp32
master weights and moments."""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn

from mm_parallel import ParallelConfig, precision
from mm_parallel.ops import low_precision
from mm_parallel.optimizer import DistributedOptimizer, OptimizerConfig
from mm_parallel.topology import Topology

SOLO = Topology.build(ParallelConfig(), 1, 0)


def numpy_bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> nearest bfloat16 (ties to even) -> float32, on the bits."""
    bits = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


@pytest.fixture
def bf16_active():
    precision.activate(precision.Precision("bf16"))
    yield
    precision.activate(precision.Precision())


def test_bf16_rounding_equals_round_to_nearest_even():
    rng = np.random.default_rng(0)
    values = (rng.standard_normal(200_000) * np.exp(rng.uniform(-40, 40, 200_000))).astype(np.float32)
    ulp = np.spacing(np.float32(1.0)) * 2 ** 16
    ties = np.array([1 + ulp / 2, 1 + 1.5 * ulp, -3 - ulp, 0.5 + ulp / 4, 0.0, -0.0], np.float32)
    for a in (values, ties):
        ours = low_precision.round_to_bf16(Tensor(a)).asnumpy()
        np.testing.assert_array_equal(ours, numpy_bf16(a))
        np.testing.assert_array_equal(ours, Tensor(a).astype(ms.bfloat16).astype(ms.float32).asnumpy())


def test_emulated_bf16_linear_rounds_operands_results_and_gradients():
    from mm_parallel.tensor_parallel import linear

    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 32)).astype(np.float32)
    w = Parameter(Tensor(rng.standard_normal((16, 32)).astype(np.float32)).astype(ms.bfloat16), name="w")
    w_values = w.astype(ms.float32).asnumpy()
    out = linear(Tensor(x), w, None)
    assert out.dtype == ms.float32  # emulated: float32 storage
    want = numpy_bf16((numpy_bf16(x).astype(np.float64) @ w_values.T.astype(np.float64)).astype(np.float32))
    got = out.asnumpy()
    # fp32 accumulation against float64: the odd value may land one bf16 step away
    ulps = np.abs(got - want) / np.maximum(np.abs(want) * 2.0 ** -7, 1e-30)
    assert np.mean(got != want) < 0.02 and ulps.max() <= 1.0
    np.testing.assert_array_equal(got, numpy_bf16(got))

    dy = rng.standard_normal((6, 16)).astype(np.float32)
    dx, (dw,) = ms.grad(lambda t: (linear(t, w, None) * Tensor(dy)).sum(), 0, [w])(Tensor(x))
    assert dw.dtype == ms.bfloat16  # a parameter's gradient comes back in its own dtype
    rounded_dy = numpy_bf16(dy)
    np.testing.assert_allclose(dx.asnumpy(), numpy_bf16(rounded_dy @ w_values), rtol=2 ** -7)
    np.testing.assert_allclose(dw.astype(ms.float32).asnumpy(), rounded_dy.T @ numpy_bf16(x), rtol=2 ** -6, atol=1e-6)


def test_fp32_path_is_unchanged_by_the_policy():
    from mm_parallel.tensor_parallel import linear

    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((4, 8)).astype(np.float32), rng.standard_normal((3, 8)).astype(np.float32)
    out = linear(Tensor(x), Parameter(Tensor(w), name="w"), None).asnumpy()
    # fp32 within the dot product's rounding (8 terms: 8 x 2^-24 x sum|x w| ~ 3e-6; the kernel's
    # summation order varies from run to run, a 1e-6 tolerance failed once); bf16 would be off by ~1e-2
    np.testing.assert_allclose(out, x @ w.T, rtol=1e-5, atol=8 * 2.0 ** -24 * (np.abs(x) @ np.abs(w).T).max())
    assert not np.array_equal(out, numpy_bf16(out))  # nothing rounded


def test_attention_and_norms_round_in_a_bf16_run(bf16_active):
    from mm_parallel import ops as kernels

    rng = np.random.default_rng(3)
    q, k, v = (Tensor(rng.standard_normal((1, 5, 2, 8)).astype(np.float32)) for _ in range(3))
    out = kernels.attention(q, k, v, causal=True).asnumpy()
    np.testing.assert_array_equal(out, numpy_bf16(out))
    h = kernels.rms_norm(Tensor(rng.standard_normal((3, 8)).astype(np.float32))).asnumpy()
    np.testing.assert_array_equal(h, numpy_bf16(h))
    precision.activate(precision.Precision())
    h32 = kernels.rms_norm(Tensor(rng.standard_normal((3, 8)).astype(np.float32))).asnumpy()
    assert not np.array_equal(h32, numpy_bf16(h32))


class _Model(nn.Cell):
    _keep_in_fp32_modules = ["time_embedder"]

    def __init__(self):
        super().__init__()
        from mm_parallel.blocks import Linear, RMSNorm

        self.proj = Linear(8, 8)
        self.time_embedder = Linear(8, 8)
        self.norm = RMSNorm(8)
        self.expert_bias = precision.keep_in_fp32(Parameter(Tensor(np.zeros(4, np.float32)), name="expert_bias",
                                                            requires_grad=False))
        self.frozen = Parameter(Tensor(np.ones(4, np.float32)), name="frozen", requires_grad=False)

    def construct(self, x):
        return self.norm(self.proj(x) + self.time_embedder(x))


def test_apply_casts_all_but_kept_modules_and_marked_parameters():
    model = _Model()
    cast = precision.apply(model, precision.Precision("bf16"))
    try:
        dtypes = {p.name: p.dtype for p in model.get_parameters()}
        assert cast == 4 and dtypes["proj.weight"] == dtypes["proj.bias"] == dtypes["norm.weight"] == ms.bfloat16
        assert dtypes["frozen"] == ms.bfloat16  # a frozen base is cast too (a LoRA run's memory)
        assert dtypes["time_embedder.weight"] == dtypes["time_embedder.bias"] == dtypes["expert_bias"] == ms.float32
        # 64 + 8 + 8 + 4 values cast against 64 + 8 kept and 4 marked: config.json says bfloat16
        assert precision.dominant_dtype_name(model.get_parameters()) == "bfloat16"
        assert precision.parameter_bytes(model.trainable_params()) == 2 * (64 + 8 + 8) + 4 * (64 + 8)
        out = model(Tensor(np.ones((2, 8), np.float32)))
        assert out.dtype == ms.float32
    finally:
        precision.activate(precision.Precision())


def test_policy_settings_and_errors():
    assert precision.Precision("bf16").param_dtype == ms.bfloat16
    assert precision.Precision("bf16", "bf16").accumulate_dtype == ms.bfloat16
    assert precision.dtype_named("bfloat16") == ms.bfloat16 and precision.Precision("fp16").torch_name == "float16"
    with pytest.raises(ValueError, match="choose one of fp32, bf16, fp16"):
        precision.Precision("int8")
    with pytest.raises(ValueError, match="grad_dtype 'fp16' must be fp32 or the precision itself"):
        precision.Precision("bf16", "fp16")
    fp16 = precision.Precision("fp16").optimizer_config(OptimizerConfig())
    assert fp16.dynamic_loss_scale  # Megatron's default for fp16
    assert not precision.Precision("fp16").optimizer_config(OptimizerConfig(loss_scale=128.0)).dynamic_loss_scale
    assert not precision.Precision("bf16").optimizer_config(OptimizerConfig()).dynamic_loss_scale


def test_device_branch_casts_instead_of_rounding(monkeypatch):
    """On Ascend the kernels take low-precision tensors as they are (MindSpore casts on CPU too)."""
    monkeypatch.setattr(low_precision, "emulated", lambda: False)
    x = Tensor(np.array([1.0 + 2.0 ** -9, 3.0], np.float32))
    cast = low_precision.to_compute(x, ms.bfloat16)
    assert cast.dtype == ms.bfloat16
    np.testing.assert_array_equal(cast.astype(ms.float32).asnumpy(), numpy_bf16(x.asnumpy()))
    w = Parameter(Tensor(np.ones(2, np.float32)).astype(ms.bfloat16), name="w")
    assert low_precision.compute_weight(w) is w
    assert low_precision.to_compute(cast, ms.float32).dtype == ms.float32
    kept = low_precision.rounded(x, ms.bfloat16)  # bf16 values, float32 compute (the reference attention)
    assert kept.dtype == ms.float32
    np.testing.assert_array_equal(kept.asnumpy(), numpy_bf16(x.asnumpy()))


def test_fp16_rounding_overflows_to_inf():
    x = Tensor(np.array([1.0, 70000.0, 1e-8], np.float32))
    out = low_precision.to_compute(x, ms.float16).asnumpy()
    assert out[0] == 1.0 and np.isinf(out[1]) and out[2] == np.float32(np.float16(1e-8))


def test_bf16_training_keeps_fp32_master_weights(bf16_active):
    """bf16 parameters, gradients summed in fp32, AdamW on fp32 masters: after a step every
    parameter is its master weight rounded to bf16, and the state is 12 bytes per value."""
    from mm_parallel.ops.device import as_type

    model = _Model()
    precision.cast_parameters(model, precision.Precision("bf16"), _Model._keep_in_fp32_modules)
    params = model.trainable_params()
    opt = DistributedOptimizer(model, OptimizerConfig(lr=1e-2, clip_grad=0), SOLO)
    x = Tensor(np.random.default_rng(4).standard_normal((4, 8)).astype(np.float32))
    grad_fn = ms.value_and_grad(lambda: (model(x) ** 2).mean(), None, params)
    losses = []
    for _ in range(3):
        loss, grads = grad_fn()
        losses.append(float(loss.asnumpy()))
        total = [as_type(g, ms.float32) for g in grads]
        assert all(g.dtype == ms.float32 for g in total)
        opt.step(total)
    assert losses[-1] < losses[0]
    assert opt.state_bytes() == 12 * sum(int(p.size) for p in params)
    for p, state in zip(params, opt.param_states()):
        assert state["master"].dtype == np.float32
        np.testing.assert_array_equal(p.astype(ms.float32).asnumpy(),
                                      state["master"] if p.dtype == ms.float32 else numpy_bf16(state["master"]))
