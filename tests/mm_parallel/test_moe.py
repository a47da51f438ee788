"""mm_parallel.moe on one process: the pure token layout, the layer against a float64 numpy
reference and against transformers' Qwen3-VL-MoE sparse block (output, aux loss, gradients), the
expert layouts on disk, the grouped matmul against a per-expert loop, metrics and the expert bias."""

import numpy as np
import pytest

from mm_parallel.moe import token_layout as tl

H, INNER, E, K = 16, 6, 8, 3  # 2I != H: the two fused expert layouts differ in shape


# -- token layout (pure) ------------------------------------------------------------------------

def test_capacity_keeps_the_largest_weights_or_the_earliest_tokens():
    experts = np.array([[0, 1], [0, 2], [0, 1], [1, 0]])
    weights = np.array([[0.1, 0.9], [0.8, 0.2], [0.5, 0.5], [0.6, 0.4]])
    by_probs = tl.capacity_keep(experts, weights, 3, 2, "probs")  # expert 0: .1 .8 .5 .4 -> .8 .5; 1: .9 .5 .6 -> .9 .6
    assert by_probs.tolist() == [[False, True], [True, True], [True, False], [True, False]]
    by_position = tl.capacity_keep(experts, weights, 3, 2, "position")  # expert 0: tokens 0, 1 kept
    assert by_position.tolist() == [[True, True], [True, True], [False, True], [False, False]]
    assert tl.capacity(tokens=8, top_k=2, num_experts=4, factor=0.75) == 3


def test_send_layout_sorts_kept_slots_by_expert_and_pads_to_capacity():
    experts = np.array([[2, 0], [0, 1]])
    keep = np.array([[True, True], [False, True]])
    layout = tl.send_layout(experts, keep, 3)
    assert layout.tokens.tolist() == [0, 1, 0] and layout.experts.tolist() == [0, 1, 2]
    assert layout.counts.tolist() == [1, 1, 1] and layout.row_of_slot.tolist() == [[2, 0], [-1, 1]]
    padded = tl.send_layout(experts, keep, 3, pad_to=2)
    assert padded.tokens.tolist() == [0, -1, 1, -1, 0, -1] and padded.row_of_slot.tolist() == [[4, 0], [-1, 2]]
    with pytest.raises(ValueError, match="capacity"):
        tl.send_layout(np.array([[0], [0], [0]]), None, 2, pad_to=2)


def test_received_rows_are_grouped_by_local_expert_and_padded():
    counts = np.array([[1, 2, 0, 1], [0, 1, 3, 0]])  # two sources, 4 experts, 2 ranks
    assert tl.received_experts(counts, rank=0, local=2).tolist() == [0, 1, 1, 1]
    assert tl.received_experts(counts, rank=1, local=2).tolist() == [1, 0, 0, 0]
    groups = tl.expert_groups(np.array([1, 0, 0, 0, -1]), local=2, sink=4)
    assert groups.width == 3 and groups.counts.tolist() == [3, 1]
    assert groups.padded.tolist() == [1, 2, 3, 0, 4, 4] and groups.slot.tolist() == [3, 0, 1, 2, 6]
    empty = tl.expert_groups(np.array([-1]), local=2, sink=0)  # a rank whose experts get no token
    assert empty.width == 1 and empty.padded.tolist() == [0, 0] and empty.slot.tolist() == [2]


# -- float64 numpy reference ----------------------------------------------------------------------

def _weights(seed=0, shared=0):
    rng = np.random.default_rng(seed)
    w = {"gate.weight": rng.standard_normal((E, H)) * 0.5,
         "experts.gate_up_proj": rng.standard_normal((E, 2 * INNER, H)) * 0.3,
         "experts.down_proj": rng.standard_normal((E, H, INNER)) * 0.3}
    if shared:
        w.update({"shared_expert.gate_proj.weight": rng.standard_normal((shared, H)) * 0.3,
                  "shared_expert.up_proj.weight": rng.standard_normal((shared, H)) * 0.3,
                  "shared_expert.down_proj.weight": rng.standard_normal((H, shared)) * 0.3,
                  "shared_expert_gate.weight": rng.standard_normal((1, H)) * 0.3})
    return w


def _silu(v):
    return v / (1 + np.exp(-v))


def _softmax(v):
    e = np.exp(v - v.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def numpy_moe(x, w, cfg):
    """The layer's forward in float64 numpy (module docstrings of router / experts / layer)."""
    logits = x @ w["gate.weight"].T
    probs = _softmax(logits)
    scores = probs if cfg.score_order == "softmax_topk" else logits
    chosen = np.argsort(-scores, -1, kind="stable")[:, :cfg.top_k]
    if cfg.score_order == "softmax_topk":
        weights = np.take_along_axis(probs, chosen, 1)
        weights = weights / weights.sum(-1, keepdims=True) if cfg.norm_topk_prob else weights
    else:
        weights = _softmax(np.take_along_axis(logits, chosen, 1))
    keep = np.ones_like(chosen, bool)
    if cfg.capacity_factor:
        cap = tl.capacity(x.shape[0], cfg.top_k, cfg.num_experts, cfg.capacity_factor)
        keep = tl.capacity_keep(chosen, weights, cfg.num_experts, cap, cfg.drop_policy)
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(cfg.top_k):
            if keep[t, j]:
                e = chosen[t, j]
                gate, up = np.split(w["experts.gate_up_proj"][e] @ x[t], 2)
                y[t] += weights[t, j] * (w["experts.down_proj"][e] @ (_silu(gate) * up))
    if cfg.shared_expert_intermediate_size:
        s = (_silu(x @ w["shared_expert.gate_proj.weight"].T) * (x @ w["shared_expert.up_proj.weight"].T)) \
            @ w["shared_expert.down_proj.weight"].T
        y += s / (1 + np.exp(-(x @ w["shared_expert_gate.weight"].T)))
    counts = np.bincount(chosen.reshape(-1), minlength=E) / x.shape[0]
    aux = E * (counts * probs.mean(0)).sum()
    lse = np.log(np.exp(logits).sum(-1))
    return y, aux, (lse ** 2).mean()


def _layer(cfg, weights):
    from mindspore import Tensor

    from mm_parallel.moe import MoELayer

    layer = MoELayer(cfg)
    params = dict(layer.parameters_and_names())
    for name, value in weights.items():
        params[name].set_data(Tensor(value.astype(np.float32)))
    return layer


@pytest.mark.parametrize("options", [
    {},
    {"score_order": "topk_softmax"},
    {"norm_topk_prob": False},
    {"capacity_factor": 0.5},
    {"capacity_factor": 0.5, "drop_policy": "position", "pad_to_capacity": True},
    {"dispatcher": "allgather", "capacity_factor": 0.5},
    {"shared_expert_intermediate_size": 12, "shared_expert_gate": True},
])
def test_layer_matches_a_float64_numpy_reference(options):
    from mindspore import Tensor

    from mm_parallel.moe import MoEConfig, load_balancing_loss, router_z_loss

    cfg = MoEConfig(hidden_size=H, moe_intermediate_size=INNER, num_experts=E, top_k=K, **options)
    weights = _weights(1, cfg.shared_expert_intermediate_size)
    x = np.random.default_rng(2).standard_normal((10, H))
    layer = _layer(cfg, weights)
    y = layer(Tensor(x.astype(np.float32))).asnumpy()
    want, aux, z = numpy_moe(x, weights, cfg)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(load_balancing_loss([layer.stats], E).asnumpy()), aux, rtol=1e-5)
    np.testing.assert_allclose(float(router_z_loss([layer.stats], E).asnumpy()), z, rtol=1e-5)


# -- transformers' Qwen3-VL-MoE sparse block -------------------------------------------------------

def test_layer_matches_transformers_qwen3_vl_moe_block():
    """Same weights, two layers' routing with a padding mask: output, the aux loss of
    load_balancing_loss_func, and the router / expert / input gradients of y^2 + coef * aux."""
    import mindspore as ms
    import torch
    from mindspore import Tensor
    from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as qwen
    from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig

    from mm_parallel.moe import MoEConfig, load_balancing_loss

    config = Qwen3VLMoeTextConfig(hidden_size=H, moe_intermediate_size=INNER, num_experts=E, num_experts_per_tok=K,
                                  hidden_act="silu", router_aux_loss_coef=0.1)
    weights = _weights(0)
    reference = qwen.Qwen3VLMoeTextSparseMoeBlock(config).double()
    for name, value in weights.items():
        reference.get_parameter(name).data = torch.tensor(value)
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((2, 5, H)) for _ in range(2)]
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    coef = config.router_aux_loss_coef

    torch_x = [torch.tensor(x, requires_grad=True) for x in xs]
    outputs = [reference(x) for x in torch_x]
    logits = tuple(x.reshape(-1, H) @ reference.gate.weight.T for x in torch_x)
    torch_aux = qwen.load_balancing_loss_func(logits, E, K, torch.tensor(mask))
    (sum((y ** 2).sum() for y in outputs) + coef * torch_aux).backward()

    layer = _layer(MoEConfig.from_hf(config), weights)
    params = layer.trainable_params()

    def loss(a, b):
        ya, stats_a = layer(a, token_mask=mask), layer.stats
        yb, stats_b = layer(b, token_mask=mask), layer.stats
        return (ya ** 2).sum() + (yb ** 2).sum() + coef * load_balancing_loss([stats_a, stats_b], E)

    inputs = [Tensor(x.astype(np.float32)) for x in xs]
    np.testing.assert_allclose(layer(inputs[0]).asnumpy(), outputs[0].detach().numpy(), rtol=1e-4, atol=1e-5)
    layer(inputs[0], token_mask=mask)
    stats_a = layer.stats
    layer(inputs[1], token_mask=mask)
    np.testing.assert_allclose(float(load_balancing_loss([stats_a, layer.stats], E).asnumpy()),
                               float(torch_aux.detach()), rtol=1e-5)
    (dx, _), grads = ms.grad(loss, (0, 1), params)(*inputs)
    np.testing.assert_allclose(dx.asnumpy(), torch_x[0].grad.numpy(), rtol=1e-3, atol=1e-4)
    for param, grad in zip(params, grads):
        want = reference.get_parameter(param.name).grad.numpy()
        assert np.abs(grad.asnumpy() - want).max() <= 1e-4 * np.abs(want).max(), param.name


# -- experts: layouts on disk, grouped matmul --------------------------------------------------------

@pytest.mark.parametrize("layout", ["fused", "fused_transposed", "per_expert"])
def test_every_expert_layout_loads_and_saves_back_as_read(tmp_path, layout):
    from mm_parallel.hf_checkpoint import SafetensorsFolder, full_state, load_weights, write_weights
    from mm_parallel.moe import MoEConfig
    from mm_parallel.moe.checkpoint import disk_tensors

    cfg = MoEConfig(hidden_size=H, moe_intermediate_size=INNER, num_experts=E, top_k=K)
    weights = {k: v.astype(np.float32) for k, v in _weights(4).items()}
    state = {"mlp.gate.weight": weights["gate.weight"]}
    for attr in ("gate_up_proj", "down_proj"):
        state.update(disk_tensors("mlp.experts.", attr, weights[f"experts.{attr}"], layout))
    write_weights(state, str(tmp_path / "in"))
    layer = _layer(cfg, _weights(9))
    load_weights(layer, str(tmp_path / "in"), lambda name: "mlp." + name)
    assert layer.experts.checkpoint_layout == layout
    for name, value in weights.items():
        np.testing.assert_array_equal(dict(layer.parameters_and_names())[name].asnumpy(), value)
    saved = full_state(layer, lambda name: "mlp." + name)
    assert sorted(saved) == sorted(state)
    write_weights(saved, str(tmp_path / "out"))
    folder = SafetensorsFolder(str(tmp_path / "out"))
    for name, value in state.items():
        np.testing.assert_array_equal(folder.read(name), value)


def test_convert_folder_between_layouts_in_shards(tmp_path, monkeypatch):
    from mm_parallel.hf_checkpoint import SafetensorsFolder, write_weights
    from mm_parallel.moe import checkpoint
    from mm_parallel.moe.checkpoint import convert_folder, disk_tensors

    rng = np.random.default_rng(0)
    gate_up = rng.standard_normal((4, 2 * INNER, H)).astype(np.float32)
    down = rng.standard_normal((4, H, INNER)).astype(np.float32)
    state = {"model.norm.weight": np.ones(H, np.float32)}
    for attr, full in (("gate_up_proj", gate_up), ("down_proj", down)):
        state.update(disk_tensors("model.layers.0.mlp.experts.", attr, full, "per_expert"))
    write_weights(state, str(tmp_path / "a"))
    (tmp_path / "a" / "config.json").write_text("{}")
    prefix = "model.layers.0.mlp.experts."
    assert convert_folder(str(tmp_path / "a"), str(tmp_path / "b"), "fused_transposed") == {prefix: "per_expert"}
    monkeypatch.setattr(checkpoint, "_SHARD_BYTES", gate_up.nbytes)  # gate_up alone, then down with the norm
    assert convert_folder(str(tmp_path / "b"), str(tmp_path / "c"), "fused") == {prefix: "fused_transposed"}
    assert (tmp_path / "c" / "model.safetensors.index.json").exists() and (tmp_path / "c" / "config.json").exists()
    c = SafetensorsFolder(str(tmp_path / "c"))
    assert len(set(c.files.values())) == 2
    np.testing.assert_array_equal(c.read(prefix + "gate_up_proj"), gate_up)
    np.testing.assert_array_equal(c.read(prefix + "down_proj"), down)
    np.testing.assert_array_equal(c.read("model.norm.weight"), state["model.norm.weight"])


def test_the_pair_of_shapes_tells_the_fused_layouts_apart():
    from mm_parallel.moe.checkpoint import fused_layout

    assert fused_layout((2, 8, 8), (2, 8, 4)) == "fused"  # 2I = H: gate_up alone is ambiguous
    assert fused_layout((2, 8, 8), (2, 4, 8)) == "fused_transposed"
    assert fused_layout((2, 8, 4), (2, 4, 4)) == "fused"  # I = H: down alone is ambiguous
    assert fused_layout((2, 4, 8), (2, 4, 4)) == "fused_transposed"
    with pytest.raises(ValueError, match="neither"):
        fused_layout((2, 8, 4), (2, 8, 4))


def test_a_missing_expert_stack_is_named(tmp_path):
    from mm_parallel.hf_checkpoint import SafetensorsFolder, write_weights
    from mm_parallel.moe.checkpoint import detect_layout

    write_weights({"other": np.zeros(2, np.float32)}, str(tmp_path))
    with pytest.raises(KeyError, match="per-expert keys"):
        detect_layout(SafetensorsFolder(str(tmp_path)), "model.layers.3.mlp.experts.")


def test_grouped_matmul_equals_a_loop_over_experts():
    from mindspore import Tensor

    from mm_parallel.moe import GroupedExperts

    experts = GroupedExperts(4, H, INNER)
    rows = np.random.default_rng(1).standard_normal((7, H))
    tokens = Tensor(np.concatenate([rows, np.zeros((1, H))]).astype(np.float32))
    groups = tl.expert_groups(np.array([2, 0, 2, 3, 2, 0, 3, -1]), local=4, sink=7)
    np.testing.assert_allclose(experts(tokens, groups).asnumpy(), experts.per_expert_loop(tokens, groups).asnumpy(),
                               rtol=1e-5, atol=1e-6)


def grouped_matmul_stand_in(calls):
    """Ascend's grouped_matmul as MindSpore documents it for split_item=3, group_type=0 (the
    differentiable mode): x one 2-D tensor (M, K), weight one 3-D tensor (E, N, K) with
    transpose_b, group_list the int64 cumulative row counts (E,) ending at M; rows
    [g_{e-1}, g_e) times weight[e]^T. Records each call's arguments in ``calls``."""
    from mindspore import ops

    def kernel(x, weight, group_list):
        ends = group_list.asnumpy()
        calls.append((tuple(x.shape), tuple(weight.shape), str(group_list.dtype), ends.tolist()))
        assert ends.dtype == np.int64 and ends.shape == (weight.shape[0],) and ends[-1] == x.shape[0]
        starts = np.concatenate([[0], ends[:-1]])
        parts = [ops.matmul(x[int(a):int(b)], weight[e].T) for e, (a, b) in enumerate(zip(starts, ends)) if b > a]
        return ops.concat(parts, 0) if len(parts) > 1 else parts[0]

    return kernel


def test_the_ascend_grouped_matmul_branch_equals_the_batched_path(monkeypatch):
    """The fused branch (forced on, the kernel a documented-semantics stand-in) against the CPU
    path: outputs and gradients of tokens and both expert tensors, one expert without rows."""
    import sys

    import mindspore as ms
    from mindspore import Tensor

    from mm_parallel.moe import GroupedExperts
    from mm_parallel.moe import experts as experts_module

    kernel_module = sys.modules["mm_parallel.ops.grouped_matmul"]  # the module (mm_parallel.ops exports the function)

    experts = GroupedExperts(4, H, INNER)
    rows = np.random.default_rng(2).standard_normal((6, H))
    tokens = Tensor(np.concatenate([rows, np.zeros((1, H))]).astype(np.float32))
    groups = tl.expert_groups(np.array([3, 0, 3, 3, 0, 1, -1]), local=4, sink=6)  # expert 2 gets nothing
    params = experts.trainable_params()

    def run():
        return ms.value_and_grad(lambda t: (experts(t, groups) ** 2).sum(), 0, params)(tokens)

    want_loss, (want_dx, want_grads) = run()
    calls = []
    monkeypatch.setattr(experts_module, "use_fused", lambda: True)
    monkeypatch.setattr(kernel_module, "_fused_kernel", grouped_matmul_stand_in(calls))
    got_loss, (got_dx, got_grads) = run()
    assert calls and calls[0] == ((6, H), (4, 2 * INNER, H), "Int64", [2, 3, 3, 6])
    np.testing.assert_allclose(got_loss.asnumpy(), want_loss.asnumpy(), rtol=1e-5)
    np.testing.assert_allclose(got_dx.asnumpy(), want_dx.asnumpy(), rtol=1e-4, atol=1e-6)
    for got, want in zip(got_grads, want_grads):
        np.testing.assert_allclose(got.asnumpy(), want.asnumpy(), rtol=1e-4, atol=1e-6)


# -- metrics, expert bias, errors -----------------------------------------------------------------

def test_metrics_and_the_expert_bias_push_against_the_overloaded_expert():
    from mindspore import Tensor

    from mm_parallel.moe import MoEConfig, routing_metrics, update_expert_biases

    cfg = MoEConfig(hidden_size=H, moe_intermediate_size=INNER, num_experts=E, top_k=1, expert_bias=True,
                    bias_update_rate=0.1, capacity_factor=1.0)
    weights = _weights(0)
    weights["gate.weight"][0] = 3.0  # positive inputs all prefer expert 0
    layer = _layer(cfg, weights)
    x = Tensor(np.abs(np.random.default_rng(0).standard_normal((16, H))).astype(np.float32))
    layer(x)
    metrics = routing_metrics(layer)["moe"]
    assert metrics["tokens_per_expert"][0] == 2.0  # capacity ceil(16 / 8) = 2: the rest dropped
    assert metrics["dropped_fraction"] == pytest.approx(14 / 16) and metrics["imbalance"] > 1
    assert set(metrics) == {"tokens_per_expert", "imbalance", "dropped_fraction", "aux_loss", "z_loss"}
    update_expert_biases(layer)
    bias = layer.gate.expert_bias.asnumpy()
    assert bias[0] == pytest.approx(-0.1) and np.allclose(bias[1:], 0.1)
    assert routing_metrics(layer) == {}  # counts restart after each read


def test_bad_moe_settings_say_what_to_change():
    from mm_parallel import ParallelConfig, comm
    from mm_parallel.moe import MoEConfig
    from mm_parallel.moe.experts import GroupedExperts
    from mm_parallel.topology import Topology

    base = dict(hidden_size=H, moe_intermediate_size=INNER, num_experts=E, top_k=K)
    for options, message in (({"top_k": 9}, "exceeds"), ({"dispatcher": "ring"}, "dispatcher"),
                             ({"pad_to_capacity": True}, "capacity_factor"), ({"capacity_factor": 0}, "positive"),
                             ({"shared_expert_gate": True}, "shared_expert_intermediate_size")):
        with pytest.raises(ValueError, match=message):
            MoEConfig(**{**base, **options})
    with pytest.raises(ValueError, match="expert_tp=3 must be 1"):
        ParallelConfig(tp=2, expert_tp=3)
    with pytest.raises(ValueError, match="choose an ep that divides"):
        GroupedExperts(6, H, INNER, topology=Topology.build(ParallelConfig(ep=4), 4, 0))
    with pytest.raises(ValueError, match="add up to"):
        comm.all_to_all_v(np.zeros((3, 2)), Topology.build(ParallelConfig(), 1, 0).world, [2], [2])
