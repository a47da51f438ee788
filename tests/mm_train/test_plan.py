"""`mm-train plan`: what it counts equals what a run builds; the shipped real-size recipes fit.

Parameter, weight and optimizer bytes are compared with the real model of every position of a
layout (built with values in this process under `Topology.build` of that rank, cast by the run's
precision, planned by the family, with a real DistributedOptimizer) — the planner builds by shape
only. The real-size recipes are planned on the shapes of their published checkpoints
(tests/mm_train/data/hub_configs.json: the hub's config.json shape fields).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest
from helpers.hub_folders import write_hub_folder

from mm_train.plan import make_plan, memory, model_config
from mm_train.recipe import load_recipe

HUB_CONFIGS = json.loads((Path(__file__).parent / "data" / "hub_configs.json").read_text())
REAL_RECIPES = ["qwen2_5_vl_7b_sft", "qwen2_5_vl_7b_dpo", "qwen2_5_vl_7b_grpo", "wan2_1_t2v_1_3b_dpo",
                "qwen2_5_vl_32b_sft", "qwen2_5_vl_72b_sft", "qwen3_vl_8b_sft",
                "qwen3_vl_30b_a3b_sft", "qwen3_vl_30b_a3b_zero3",
                "qwen2_5_omni_7b_sft", "wan2_1_t2v_1_3b", "wan2_1_t2v_14b", "wan2_1_t2v_14b_zero3", "cogvideox_5b_t2v",
                "cogvideox1_5_5b_i2v", "cogvideox1_5_5b_t2v_lora", "wan2_2_ti2v_5b", "wan2_2_t2v_a14b"]

CASES = {
    "vl_tp2_pp2_bf16": ("qwen2_5_vl_tiny", 8, ["parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=1",
                                               "train.precision=bf16", "model.recompute=full"]),
    "vl_lora_frozen_vision": ("qwen2_5_vl_tiny_lora", 4, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "vl_vpp_zero2": ("qwen2_5_vl_tiny", 8, ["parallel.pp=2", "parallel.vpp=2", "parallel.zero_stage=2",
                                           "model.freeze=[vision]", "train.global_batch_size=16",
                                           "model.config.text_config.num_hidden_layers=4"]),
    "qwen3_moe_ep2_tp2": ("qwen3_vl_moe_tiny", 8, ["parallel.tp=2", "parallel.ep=2", "parallel.zero_stage=1",
                                                   "train.precision=bf16"]),
    "wan_tp2_cp2": ("wan2_1_t2v_tiny", 8, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp=2",
                                          "parallel.zero_stage=1"]),
    "vl_tp2_zero3_bf16": ("qwen2_5_vl_tiny", 8, ["parallel.tp=2", "parallel.pp=2", "parallel.zero_stage=3",
                                                 "parallel.zero3_min_numel=1024", "train.precision=bf16"]),
    "wan_zero3_cp2": ("wan2_1_t2v_tiny", 2, ["parallel.cp=2", "parallel.zero_stage=3",
                                            "parallel.zero3_min_numel=1024"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_predicted_parameter_and_optimizer_bytes_equal_the_real_build(case, tmp_path):
    import mindspore as ms

    import mm_parallel
    from mm_parallel.census import owned_parameters
    from mm_parallel.ops import low_precision
    from mm_parallel.sharding import sharding_of
    from mm_parallel.topology import Topology
    from mm_parallel.zero3 import shard_parameters, value_shape

    name, world, sets = CASES[case]
    recipe = load_recipe(name, [*sets, f"output_dir={tmp_path / 'out'}", f"data.path={tmp_path / 'data'}"])
    raw, config = model_config(recipe)
    positions = memory.positions(recipe.parallel, world)
    assert sum(p.count for p in positions) == world
    before = low_precision.compute_dtype()
    try:
        for position in positions:
            topo = Topology.build(recipe.parallel, world, position.rank)
            predicted = memory.static_bytes(memory.build_chunks(recipe.family, recipe, raw, config, topo), recipe,
                                            topo)
            real = memory.build_chunks(recipe.family, recipe, raw, config, topo, values=True)
            if recipe.parallel.zero_stage == 3:  # as mm_train.loop does after the plan
                assert sum(shard_parameters(chunk, topo).sharded for chunk in real) > 0
            held = [p for chunk in real for _, p, _, _ in owned_parameters(chunk)]
            trainable = [p for chunk in real for p in chunk.trainable_params()]
            optimizer = mm_parallel.DistributedOptimizer(real[0] if len(real) == 1 else real,
                                                         recipe.train.precision_policy().optimizer_config(recipe.optim),
                                                         topo)
            assert predicted["params"] == sum(math.prod(value_shape(p)) for p in held), position
            assert predicted["weights_bytes"] == sum(int(p.nbytes) for p in held), position
            grad_size = 4 if recipe.train.grad_dtype == "fp32" else 2
            # a ZeRO-3 slice's gradient is float32 like the slice
            assert predicted["grads_bytes"] == sum(int(p.size) * (4 if sharding_of(p).flat_over else grad_size)
                                                   for p in trainable), position
            assert predicted["optimizer_bytes"] == optimizer.state_bytes(), position
            if recipe.train.precision == "bf16":
                assert any(p.dtype == ms.bfloat16 for p in held)
    finally:
        low_precision.set_compute_dtype(before)


def test_a_shape_only_build_holds_no_memory():
    """A 72B stage built by shape only: no parameter's values exist (MindSpore allocates a
    declared tensor only when its data is read), and the process grows by far less than 1 GiB."""
    import resource

    from mm_parallel.topology import Topology

    recipe = load_recipe("qwen2_5_vl_72b_sft", [f"model.path={_hub_folder('Qwen2.5-VL-72B-Instruct')}"])
    raw, config = model_config(recipe)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    topo = Topology.build(recipe.parallel, 64, 0)
    chunks = memory.build_chunks(recipe.family, recipe, raw, config, topo)
    held = memory.static_bytes(chunks, recipe, topo)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    assert held["params"] > 5e9 and held["weights_bytes"] > 10 * 2 ** 30
    assert grown < 2 ** 30, f"the shape-only build grew the process by {grown / 2 ** 30:.1f} GiB"


_FOLDERS = {}


def _hub_folder(key: str) -> str:
    """A model folder holding only the published config.json of ``key`` (helpers/hub_folders.py)."""
    if key not in _FOLDERS:
        import tempfile

        _FOLDERS[key] = write_hub_folder(os.path.join(tempfile.mkdtemp(prefix="hub_"), key), key)
    return _FOLDERS[key]


def _planned(name: str, *sets: str) -> dict:
    recipe = load_recipe(name)
    key = next(k for k in HUB_CONFIGS if k != "_comment" and recipe.model.path.rstrip("/").endswith(k))
    return make_plan(load_recipe(name, [f"model.path={_hub_folder(key)}", *sets]))


@pytest.mark.parametrize("name", REAL_RECIPES)
def test_every_shipped_real_size_recipe_fits_on_its_cluster(name):
    plan = _planned(name)
    recipe = load_recipe(name)
    assert plan["devices"] == recipe.cluster.nodes * recipe.cluster.devices_per_node
    assert plan["fits"], json.dumps({k: v for k, v in plan.items() if k != "ranks"}, indent=1)
    assert plan["peak_bytes"] <= plan["usable_bytes"] < plan["device_memory_bytes"]
    assert sum(r["count"] for r in plan["ranks"]) == plan["devices"]
    for rank in plan["ranks"]:
        parts = ("weights_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "optimizer_step_buffers_bytes")
        assert all(rank[k] >= 0 for k in parts)
        # the step's buffers come after the backward has freed the activations (and ZeRO-3's gathered weight)
        assert rank["total_bytes"] == sum(rank[k] for k in parts[:3]) + max(
            rank["activations_bytes"] + rank["zero3_gather_bytes"], rank["optimizer_step_buffers_bytes"],
            rank["kv_cache_bytes"])  # grpo: the rollouts' cache, while the activations are not there
    assert plan["step_time_s"] > 0 and 0 < plan["mfu"] < 1
    assert plan["samples_per_s"] == pytest.approx(recipe.train.global_batch_size / plan["step_time_s"])


def test_grpo_is_planned_with_its_rollouts():
    """qwen2_5_vl_7b_grpo: each prompt's completions are the sequences trained, the generation's
    time (prefill and one-token steps, launch-bound) and its key/value cache are counted; more
    completions or longer ones cost more time, and the same step without generation costs less."""
    plan = _planned("qwen2_5_vl_7b_grpo")
    generate = plan["breakdown"]["generate"]
    assert 0 < generate < plan["step_time_s"] and any("grpo:" in note for note in plan["notes"])
    assert all(rank["kv_cache_bytes"] > 0 for rank in plan["ranks"])
    longer = _planned("qwen2_5_vl_7b_grpo", "grpo.max_completion_length=1536", "data.max_length=3072")
    assert longer["breakdown"]["generate"] > generate
    reused = _planned("qwen2_5_vl_7b_grpo", "grpo.num_iterations=2")  # a generation serves two steps
    assert reused["breakdown"]["generate"] < generate
    more = _planned("qwen2_5_vl_7b_grpo", "grpo.num_generations=16")
    assert more["step_time_s"] > plan["step_time_s"] and more["ranks"][0]["kv_cache_bytes"] > \
        plan["ranks"][0]["kv_cache_bytes"]


def test_the_old_72b_layout_is_shown_not_to_fit():
    """TP2 x PP8 on 2 x 8 leaves dp = 1: ZeRO shards nothing, each rank holds ~4.4 B parameters
    with fp32 gradients and Adam state (the reason the recipe moved to 8 x 8)."""
    plan = _planned("qwen2_5_vl_72b_sft", "cluster.nodes=2")
    assert not plan["fits"]
    widest = max(plan["ranks"], key=lambda r: r["total_bytes"])
    # dp 1: the whole fp32 state (master + 2 moments) of every trained parameter, 3 x its fp32 gradient
    assert widest["optimizer_bytes"] == pytest.approx(3 * widest["grads_bytes"], rel=1e-6)
    assert plan["peak_bytes"] > 64 * 2 ** 30


def test_plan_command_prints_one_json_object(tmp_path, capsys):
    from mm_train.cli import main

    folder = _hub_folder("Wan2.1-T2V-1.3B-Diffusers/transformer")
    code = main(["plan", "wan2_1_t2v_1_3b", "--set", f"model.path={folder}", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert code == 0 and plan["fits"] is True
    for key in ("devices", "ranks", "peak_bytes", "step_time_s", "samples_per_s", "tokens_per_s", "mfu",
                "breakdown"):
        assert key in plan
    assert {"count", "params", "weights_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
            "total_bytes"} <= set(plan["ranks"][0])
    # 81 frames of 480 x 832 (the largest aspect bucket of 399,360 pixels): 21 latent frames of 30 x 52 patches
    assert math.isclose(plan["tokens_per_s"], plan["samples_per_s"] * 21 * 30 * 52, rel_tol=1e-9)
    assert math.isclose(plan["tokens_per_s_per_device"], plan["tokens_per_s"] / plan["devices"], rel_tol=1e-9)
    code = main(["plan", "wan2_1_t2v_1_3b", "--set", f"model.path={folder}", "--device", "ascend-910b4",
                 "--nodes", "1", "--devices-per-node", "1", "--set", "parallel.cp=1", "--set",
                 "parallel.zero_stage=0", "--set", "model.recompute=none"])
    out = capsys.readouterr()
    assert code == 3 and "DOES NOT FIT" in out.out and "does not fit" in out.err


# Wan2.1-14B's DiT shapes, inline (random weights): ~14 B parameters, far beyond this host
_WAN_14B_INLINE = ["model.config.num_attention_heads=40", "model.config.attention_head_dim=128",
                   "model.config.ffn_dim=13824", "model.config.num_layers=40", "model.config.text_dim=4096"]


def test_run_refuses_a_layout_that_does_not_fit_this_machine_unless_forced(tmp_path, capsys, monkeypatch):
    from mm_train import loop
    from mm_train.cli import main

    sets = [a for s in _WAN_14B_INLINE + [f"output_dir={tmp_path / 'out'}"] for a in ("--set", s)]
    started = []
    monkeypatch.setattr(loop, "train", lambda recipe, **kw: started.append(recipe) or [])
    for nproc in ("1", "2"):  # refused before msrun would start
        assert main(["run", "wan2_1_t2v_tiny", *sets, "--nproc", nproc]) == 2
        err = capsys.readouterr().err
        assert "GiB" in err and "--force" in err and "parallel.tp" in err, err
    assert not started and not (tmp_path / "out").exists()
    assert main(["run", "wan2_1_t2v_tiny", *sets, "--force"]) == 0
    assert len(started) == 1


def test_tiny_recipes_fit_this_machine_as_their_runs_are_started():
    from mm_train.plan import machine_device, refuse_unfitting

    for name in ("qwen2_5_vl_tiny", "qwen3_vl_moe_tiny", "wan2_1_i2v_tiny", "cogvideox1_5_i2v_tiny"):
        recipe = load_recipe(name)
        assert machine_device(recipe) == "cpu"
        plan = refuse_unfitting(recipe, 1, 2)
        assert plan["fits"] and plan["demand_bytes"] == sum(r["total_bytes"] * r["count"] for r in plan["ranks"])


def test_search_candidates_tile_the_world_and_split_the_batch():
    from mm_train.plan.search import candidates

    seen = list(candidates(8, 4, 16, moe=False))
    assert len(seen) == len({json.dumps(c, sort_keys=True) for c in seen})
    for c in seen:
        p = c["parallel"]
        model_parallel = p["tp"] * p["pp"] * p["cp"]
        assert 8 % model_parallel == 0 and p["tp"] <= 4 and p["ep"] == 1
        dp = 8 // model_parallel
        assert 16 % (c["micro_batch_size"] * dp) == 0
        micro_batches = 16 // (c["micro_batch_size"] * dp)
        assert p["vpp"] == 1 or (p["pp"] > 1 and micro_batches % p["pp"] == 0)
        assert p["sequence_parallel"] == (p["tp"] > 1) and (dp > 1 or p["zero_stage"] == 0)
        assert c["offload"] in ((None, "optimizer") if p["zero_stage"] == 3 else (None,))  # offload with ZeRO-3
    assert {c["offload"] for c in seen} == {None, "optimizer"}
    layouts = {(c["parallel"]["tp"], c["parallel"]["pp"], c["parallel"]["cp"]) for c in seen}
    assert (8, 1, 1) not in layouts and (4, 2, 1) in layouts and (1, 1, 8) in layouts
    moe = list(candidates(8, 8, 8, moe=True))
    assert {c["parallel"]["ep"] for c in moe if c["parallel"]["tp"] == 2 and c["parallel"]["pp"] == 1} == {1, 2, 4}


def test_search_lists_what_fits_fastest_first_as_plan_predicts_each(capsys):
    from mm_train.cli import main
    from mm_train.plan import make_plan
    from mm_train.plan.search import search, with_layout

    folder = _hub_folder("Qwen2.5-VL-7B-Instruct")
    recipe = load_recipe("qwen2_5_vl_7b_sft", [f"model.path={folder}", "cluster.devices_per_node=4"])
    result = search(recipe)
    assert result["tried"] > result["fitting"] + sum(result["refused"].values())  # the rest do not fit
    layouts = result["layouts"]
    assert layouts and all(e["peak_bytes"] > 0 for e in layouts)
    speeds = [e["samples_per_s"] for e in layouts]
    assert speeds == sorted(speeds, reverse=True)
    # 28 layers cannot be cut into pp x vpp = 4 x 2 stages: refused by the preflight, counted
    assert any("num_hidden_layers=28" in reason and "4 x 2" in reason for reason in result["refused"])
    for entry in (layouts[0], layouts[-1]):
        plan = make_plan(with_layout(recipe, entry["layout"]))
        assert plan["fits"] and plan["peak_bytes"] == entry["peak_bytes"]
        assert plan["samples_per_s"] == pytest.approx(entry["samples_per_s"], rel=1e-12)
    assert main(["plan", "qwen2_5_vl_7b_sft", "--set", f"model.path={folder}", "--devices-per-node", "4",
                 "--search", "--top", "3"]) == 0
    table = capsys.readouterr().out
    assert f"{result['fitting']} fit" in table and len(table.strip().splitlines()) == 2 + 3


def test_on_ascend_the_run_is_planned_on_the_recipes_device(monkeypatch):
    """Where MindSpore targets Ascend, `mm-train run` plans per device of the recipe's
    cluster.device (memory not shared between processes) instead of this host."""
    import mindspore

    from mm_train.plan import machine_device, refuse_unfitting

    real = mindspore.get_context
    monkeypatch.setattr(mindspore, "get_context", lambda key: "Ascend" if key == "device_target" else real(key))
    recipe = load_recipe("wan2_1_t2v_tiny", ["cluster.device=ascend-910b4"])
    assert machine_device(recipe) == "ascend-910b4"
    plan = refuse_unfitting(recipe, 1, 2)
    assert plan["device"] == "ascend-910b4" and plan["demand_bytes"] == plan["peak_bytes"]
    big = load_recipe("wan2_1_t2v_tiny", ["cluster.device=ascend-910b4", *_WAN_14B_INLINE])
    with pytest.raises(ValueError, match="per device on 1 x 2 ascend-910b4"):
        refuse_unfitting(big, 1, 2)


def test_a_ready_feature_cache_is_planned_at_its_largest_clip(tmp_path):
    """data.kind video_features: the plan reads the cache's index (its latents' shapes), not the
    data section's defaults (81 frames of 480 x 832), which would refuse a run of small clips."""
    from mm_train.families.video.data import clip_shape

    lines = [{"index": i, "features": {"latents": [16, f, 8, 12], "prompt_embeds": [64, 32]}} for i, f in
             enumerate((3, 5))]
    (tmp_path / "index-r000.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    recipe = load_recipe("wan2_1_t2v_tiny", ["data.kind=video_features", f"data.path={tmp_path}"])
    assert clip_shape(recipe.data, read_cache=True) == {"num_frames": 17, "max_area": 64 * 96, "height": 64,
                                                        "width": 96, "text_length": 64}
    assert clip_shape(recipe.data)["num_frames"] == recipe.data.num_frames == 81  # the data path keeps its own
    plan = make_plan(recipe, 1, 1, "cpu", complete_config=False)
    assert plan["fits"] and "17 frames of 64 x 96" in plan["notes"][0]


def test_the_optimizer_steps_bucketed_buffers_are_in_the_peak():
    """After the backward the step holds its reduced gradients and one bucket's transients
    (benchmarks/optimizer_step_memory.py measures them): a rank's peak is its static bytes plus
    the larger of those and its activations; the 72B recipe's stages peak in the step."""
    plan = _planned("qwen2_5_vl_72b_sft")
    assert plan["fits"]
    in_step = [r for r in plan["ranks"] if r["optimizer_step_buffers_bytes"] > r["activations_bytes"]]
    assert in_step and all(r["total_bytes"] == r["weights_bytes"] + r["grads_bytes"] + r["optimizer_bytes"]
                           + r["optimizer_step_buffers_bytes"] for r in in_step)
    # a bucket of the default size at most: the step's buffers fall with smaller buckets, not its state
    smaller = _planned("qwen2_5_vl_72b_sft", "optim.bucket_numel=10000000")
    for big, small in zip(plan["ranks"], smaller["ranks"]):
        assert small["optimizer_step_buffers_bytes"] < big["optimizer_step_buffers_bytes"]
        assert abs(small["optimizer_bytes"] - big["optimizer_bytes"]) < 3 * 4 * 8 * 1000  # padding only


def test_online_encoding_costs_every_rank_the_vae_and_t5_forward_of_its_samples():
    """CogVideoX with data.online: the step gains the VAE encoder's and T5's FLOPs of the rank's
    G / dp samples at devices.yaml's encode efficiency, whatever tp (every rank of a tp group
    encodes its sample) — a quarter of them with data.encoder_dp over tp 4 (4 micro-batches a rank,
    one round); without a readable encoder folder the 5B's shapes are assumed, and said."""
    from mm_models_video.cogvideox.flops import vae_encode_flops
    from mm_models_video.encoders.t5 import t5_encoder_flops
    from mm_train.families.video.encoders import T5_XXL
    from mm_train.plan import efficiency_of, load_devices

    cached = _planned("cogvideox_5b_t2v")
    assert cached["breakdown"]["encode"] == 0.0
    known = load_devices()
    peak = known["devices"]["ascend-910b2"]["peak_tflops"] * 1e12
    flops = vae_encode_flops({}, 49, 480, 720) + t5_encoder_flops(T5_XXL, 226)  # 345,600 pixels: 480 x 720 frames
    want = {}
    for tp in (4, 2):
        online = _planned("cogvideox_5b_t2v", "data.online=true", f"parallel.tp={tp}")
        samples_per_rank = 8 / (8 // tp)
        want[tp] = flops * samples_per_rank / (peak * efficiency_of(known, "ascend-910b2")["encode"])
        assert online["breakdown"]["encode"] == pytest.approx(want[tp], rel=1e-9)
        assert any("5B vae and text_encoder shapes" in note for note in online["notes"])
    shared = _planned("cogvideox_5b_t2v", "data.online=true", "parallel.tp=4", "data.encoder_dp=true")
    assert shared["breakdown"]["encode"] == pytest.approx(want[4] / 4, rel=1e-9)



def _tower_and_model(tower_flops: float = 5e12, model_flops: float = 7e12):
    from mm_train.plan.workload import LayerStack, Workload

    tower = LayerStack("tower", 4, 1024, 64, outside=256, inside=768, heads=4, keys=64, reference=1600,
                       pipelined=False, runs_whole=True, flops=tower_flops)
    model = LayerStack("model", 8, 2048, 128, outside=512, inside=2048, heads=8, keys=2048, reference=3000)
    return Workload([tower, model], tower_flops + model_flops, 2048, boundary_hidden=128), \
        Workload([model], model_flops, 2048, boundary_hidden=128)


def test_a_tower_runs_whole_on_each_rank_of_the_first_stage():
    """The VL towers are plain linears every rank of the first stage runs on its whole sample: tp,
    sp and cp divide neither their activations nor their FLOPs, and pp puts their FLOPs on the
    first stage alone (before, all were divided like the language model's)."""
    from mm_parallel.topology import Topology
    from mm_train.plan import load_devices, timing

    device = load_devices()["devices"]["ascend-910b2"]
    both, model_only = _tower_and_model()
    tower_bytes = {}
    for layout in ("parallel.tp=1", "parallel.tp=2", "parallel.tp=2 parallel.sequence_parallel=true",
                   "parallel.cp=2", "parallel.tp=2 parallel.pp=2"):
        recipe = load_recipe("qwen2_5_vl_tiny", layout.split() + ["model.recompute=none"])
        topo = Topology.build(recipe.parallel, 4, 0)

        def kept(workload):
            return memory.activation_bytes(workload, recipe, topo, device, 4)["activations_layers_bytes"]

        tower_bytes[layout] = kept(both) - kept(model_only)
        passes, t, c, p = 3, topo.tp.size, topo.cp.size, topo.pp.size
        first = timing.rank_step_flops(both, passes, topo)
        assert first == pytest.approx(passes * 7e12 / (t * c * p) + passes * 5e12)
        if p > 1:
            last = Topology.build(recipe.parallel, 4, 2)
            assert last.is_last_stage and timing.rank_step_flops(both, passes, last) == pytest.approx(
                passes * 7e12 / (t * c * p))
    b, size = recipe.train.micro_batch_size, memory.DTYPE_BYTES[recipe.train.precision]
    # layers x tokens x b x (outside + inside) elements, whatever the layout
    assert len(set(tower_bytes.values())) == 1 and tower_bytes["parallel.tp=1"] == 4 * 1024 * b * 1024 * size
    frozen = dataclasses.replace(both, stacks=[dataclasses.replace(both.stacks[0], trained=False),
                                               both.stacks[1]], frozen_flops=5e12)
    topo = Topology.build(load_recipe("qwen2_5_vl_tiny", ["parallel.pp=2"]).parallel, 2, 0)
    assert timing.rank_step_flops(frozen, 4, topo) == pytest.approx(4 * 7e12 / 2 + 2 * 5e12)  # pp: 2 forwards
    with pytest.raises(ValueError, match="a stack that runs whole sits on the first stage"):
        dataclasses.replace(both.stacks[0], pipelined=True)


def test_the_omni_plan_counts_its_audio_tower():
    """Qwen2.5-Omni's workload is Qwen2.5-VL's plus one 30 s audio through the audio tower: 3000
    feature frames, 1500 conv positions attending in chunks of n_window = 100, its FLOPs the
    model's own count; frozen in the shipped recipe, trained it adds activations and step time."""
    from mm_models_vl.qwen2_5_omni.flops import audio_flops

    recipe = load_recipe("qwen2_5_omni_7b_sft", [f"model.path={_hub_folder('Qwen2.5-Omni-7B')}"])
    config = model_config(recipe)[1]
    workload = recipe.family.workload(recipe, config)
    audio, vision = workload.stacks[:2]
    assert (audio.name, audio.layers, audio.tokens, audio.keys, audio.hidden) == ("audio tower", 32, 1500, 100, 1280)
    assert audio.runs_whole and not audio.trained and audio.flops == audio_flops(config, [3000])
    assert vision.runs_whole and workload.frozen_flops == audio.flops + vision.flops
    assert "one 30 s audio" in workload.notes[0]
    frozen, trained = _planned("qwen2_5_omni_7b_sft"), _planned("qwen2_5_omni_7b_sft", "model.freeze=[vision]")
    assert trained["ranks"][0]["activations_bytes"] > frozen["ranks"][0]["activations_bytes"]
    assert trained["step_time_s"] > frozen["step_time_s"]


def test_a_packed_row_is_planned_as_its_samples_in_a_row_of_the_budget():
    """data.packing: a micro-batch is one row of as many data.max_length samples as the budget
    holds, attention per sample (the sum of the squares of the segments). A budget of exactly two
    samples plans like two samples a micro-batch unpacked (an independent path through the
    planner); a budget two and a half samples long keeps the same samples in a longer row (20 %
    padding assumed, more memory); a step of global_batch_tokens is that many samples' tokens."""
    two = _planned("qwen2_5_vl_7b_sft", "data.max_tokens=8192")
    unpacked = _planned("qwen2_5_vl_7b_sft", "data.packing=false", "train.micro_batch_size=2")
    assert two["packing"] == {"samples_per_row": 2, "row_tokens": 8192, "row_positions": 8192,
                              "padding_fraction": 0.0} and unpacked["packing"] is None
    assert two["step_time_s"] == pytest.approx(unpacked["step_time_s"], rel=1e-9)
    assert two["breakdown"] == pytest.approx(unpacked["breakdown"], rel=1e-9)
    assert [r["activations_bytes"] for r in two["ranks"]] == [r["activations_bytes"] for r in unpacked["ranks"]]
    longer = _planned("qwen2_5_vl_7b_sft", "data.max_tokens=10240")
    assert longer["packing"]["padding_fraction"] == pytest.approx(0.2)
    assert any("20.0% padding assumed" in note for note in longer["notes"])
    assert max(r["activations_bytes"] for r in longer["ranks"]) > max(r["activations_bytes"] for r in two["ranks"])
    assert longer["step_time_s"] >= two["step_time_s"]  # the same FLOPs; the longer row crosses the stages
    by_tokens = _planned("qwen2_5_vl_7b_sft", "data.max_tokens=8192", f"train.global_batch_tokens={64 * 4096}")
    assert by_tokens["batch_samples"] == 64 and by_tokens["step_time_s"] == pytest.approx(two["step_time_s"])


def test_zero3_is_planned_as_slices_and_per_micro_batch_gathers():
    """ZeRO-3 in the plan: the weights it cuts held as float32 slices (with their gradients), the
    largest gathered whole beside the activations, and dp traffic growing with the micro-batches
    (each gathers every cut weight for its forward and backward); the rest as ZeRO-1."""
    one = _planned("qwen2_5_vl_7b_sft")
    three = _planned("qwen2_5_vl_7b_sft", "parallel.zero_stage=3")
    recipe = load_recipe("qwen2_5_vl_7b_sft")
    dp = recipe.cluster.nodes * recipe.cluster.devices_per_node // (recipe.parallel.tp * recipe.parallel.pp)
    for a, b in zip(one["ranks"], three["ranks"]):
        assert b["weights_bytes"] < a["weights_bytes"] and b["grads_bytes"] < a["grads_bytes"]
        # a slice is its own master weight: its moments alone
        assert b["optimizer_bytes"] == pytest.approx(a["optimizer_bytes"] - 4 * b["zero3_numel"] / dp, rel=1e-3)
        assert b["zero3_gather_bytes"] > 0 == a["zero3_gather_bytes"] and b["zero3_numel"] > 0
    assert three["peak_bytes"] < one["peak_bytes"]
    assert three["breakdown"]["dp"] > one["breakdown"]["dp"]
    more = _planned("qwen2_5_vl_7b_sft", "parallel.zero_stage=3", "train.global_batch_size=128")
    assert more["breakdown"]["dp"] > three["breakdown"]["dp"]  # twice the micro-batches, more gathers
    kept = _planned("qwen2_5_vl_7b_sft", "parallel.zero_stage=3", "parallel.reshard_after_forward=false")
    assert kept["breakdown"]["dp"] < three["breakdown"]["dp"] and kept["peak_bytes"] > three["peak_bytes"]


def test_offload_and_hybrid_sharding_are_planned(tmp_path, monkeypatch):
    """optim.offload moves the optimizer state to host memory (the slices' masters with it) and
    adds its copies to the step; a node's host memory is checked before launch. Hybrid sharding
    over 2 nodes (pp 1: a dp group spans both) cuts the weights over a node's 8 ranks instead of
    16, and adds the gradient's
    all-reduce across the nodes."""
    from mm_train.plan import refuse_unfitting

    three = _planned("qwen2_5_vl_7b_sft", "parallel.zero_stage=3")
    offloaded = _planned("qwen2_5_vl_7b_sft", "parallel.zero_stage=3", "optim.offload=optimizer")
    for a, b in zip(three["ranks"], offloaded["ranks"]):
        assert b["optimizer_bytes"] == 0 < b["optimizer_host_bytes"] and a["optimizer_host_bytes"] == 0
        assert b["optimizer_host_bytes"] > a["optimizer_bytes"]  # and the slices' master copies
    assert offloaded["peak_bytes"] < three["peak_bytes"] and offloaded["breakdown"]["offload"] > 0
    assert offloaded["host_bytes_per_node"] == 8 * max(r["optimizer_host_bytes"] for r in offloaded["ranks"])
    two_nodes = ["parallel.zero_stage=3", "parallel.pp=1", "cluster.nodes=2", "train.global_batch_size=32"]
    full = _planned("qwen2_5_vl_7b_sft", *two_nodes)
    hybrid = _planned("qwen2_5_vl_7b_sft", *two_nodes, "parallel.zero3_shard=node")
    assert hybrid["ranks"][0]["weights_bytes"] > full["ranks"][0]["weights_bytes"]
    assert hybrid["breakdown"]["dp"] < full["breakdown"]["dp"]  # the gathers stay on the node's links
    devices = tmp_path / "devices.yaml"
    devices.write_text("devices:\n  small-host:\n    memory_gib: 64\n    peak_tflops: 300\n    intra_gbps: 392\n"
                       "    inter_gbps: 25\n    host_memory_gib: 1\n    usable_fraction: 0.9\n"
                       "    fused_kernels: true\n")
    monkeypatch.setenv("MM_TRAIN_DEVICES", str(devices))
    monkeypatch.setattr("mm_train.plan.machine_device", lambda recipe: "small-host")
    recipe = load_recipe("qwen2_5_vl_7b_sft", [f"model.path={_hub_folder('Qwen2.5-VL-7B-Instruct')}",
                                               "parallel.zero_stage=3", "optim.offload=optimizer"])
    with pytest.raises(ValueError, match="GiB of optimizer state in each node's host memory, more than"):
        refuse_unfitting(recipe, 1, 8)


def test_dpo_is_planned_as_pairs_with_the_references_forward():
    """train.objective dpo: a sample is a pair of sequences, each run forward once more by the
    frozen reference — the compute of the SFT step times 2 x 4 / 3 (no recomputation, one stage:
    3 passes, plus the reference's one), at the same pairs a second as SFT's samples per step time;
    dpo.reference copy holds the policy's weights again, adapters_off nothing more."""
    dpo = ["train.objective=dpo", "data.kind=tiny_vl_pairs"]
    sft = make_plan(load_recipe("qwen2_5_vl_tiny"), 1, 1, "cpu", complete_config=False)
    pairs = make_plan(load_recipe("qwen2_5_vl_tiny", dpo), 1, 1, "cpu", complete_config=False)
    assert pairs["breakdown"]["compute"] == pytest.approx(sft["breakdown"]["compute"] * 8 / 3, rel=1e-9)
    assert pairs["ranks"][0]["reference_bytes"] == sft["ranks"][0]["weights_bytes"] > 0
    assert pairs["ranks"][0]["weights_bytes"] == 2 * sft["ranks"][0]["weights_bytes"]
    assert any("a pair of two sequences" in note for note in pairs["notes"])
    lora = ["dpo.reference=adapters_off"]
    off = make_plan(load_recipe("qwen2_5_vl_tiny_lora", dpo + lora), 1, 1, "cpu", complete_config=False)
    assert off["ranks"][0]["reference_bytes"] == 0


def test_a_lora_step_computes_no_weight_gradient_and_whose_pipeline_decides_the_recomputed_forward():
    """model.lora: a trained stack costs 2 forwards a sample, not 3 (no gradient of the frozen
    weights). Under pp, mm's stages run their forward again in the backward (and a frozen tower
    twice); planned as torch_npu runs it (the calibration's figures), only the recipe's recompute."""
    from mm_train.plan import load_devices, model_config, plan_on

    lora = _planned("cogvideox1_5_5b_t2v_lora", "model.recompute=none")
    full = _planned("cogvideox1_5_5b_t2v_lora", "model.recompute=none", "model.lora=null")
    assert lora["assumptions"]["passes"] == {"trained": 2.0, "frozen": 1, "recomputed": 0.0}
    assert lora["breakdown"]["compute"] == pytest.approx(full["breakdown"]["compute"] * 2 / 3, rel=1e-9)
    assert lora["mfu"] == pytest.approx(full["mfu"] * 2 / 3 * full["step_time_s"] / lora["step_time_s"], rel=1e-9)
    recipe = load_recipe("qwen2_5_vl_7b_sft", [f"model.path={_hub_folder('Qwen2.5-VL-7B-Instruct')}",
                                               "model.recompute=none", "model.freeze=[vision]"])
    cluster = {"nodes": 1, "devices_per_node": 8, "device": "ascend-910b2"}
    planned = {framework: plan_on(recipe, cluster, load_devices(), model_config(recipe), framework=framework)
               for framework in ("mm", "torch_npu")}
    assert planned["mm"]["assumptions"]["passes"] == {"trained": 4.0, "frozen": 2, "recomputed": 1.0}
    assert planned["torch_npu"]["assumptions"]["passes"] == {"trained": 3.0, "frozen": 1, "recomputed": 0.0}
    assert planned["torch_npu"]["step_time_s"] < planned["mm"]["step_time_s"]
    # frozen with its merger, the tower has no trainable parameter: the stage keeps its output, one forward
    from mm_train.plan import timing

    for freeze, forwards in (("[vision]", 2), ("[vision, merger]", 1)):
        frozen = load_recipe("qwen2_5_vl_7b_sft", [f"model.path={_hub_folder('Qwen2.5-VL-7B-Instruct')}",
                                                   f"model.freeze={freeze}"])
        workload = frozen.family.workload(frozen, model_config(frozen)[1])
        tower = next(stack for stack in workload.stacks if not stack.trained)
        assert timing.stack_passes(tower, timing.Passes.of(frozen, workload, 2)) == forwards, freeze


def test_plan_explain_lists_every_term_of_the_step_and_what_it_rests_on(capsys):
    """--explain: the terms add up to the step, largest first, each saying what it counted; the
    efficiencies name their calibration group and figures."""
    from mm_train.cli import main

    folder = _hub_folder("Qwen2.5-VL-7B-Instruct")
    assert main(["plan", "qwen2_5_vl_7b_sft", "--set", f"model.path={folder}", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert sum(t[1] for t in plan["terms"]) == pytest.approx(plan["step_time_s"], rel=1e-9)
    assert {t[0] for t in plan["terms"]} >= {"compute: language model", "compute: vision tower", "pipeline bubble",
                                             "launch: language model", "dp gradients"}
    assert main(["plan", "qwen2_5_vl_7b_sft", "--set", f"model.path={folder}", "--explain"]) == 0
    text = capsys.readouterr().out
    table = text[text.index("term by term"):text.index("assumptions:")].splitlines()[2:]
    largest_first = [t[0] for t in sorted(plan["terms"], key=lambda t: -t[1])]
    assert [line[2:42].strip() for line in table] == largest_first
    assert "calibration group ascend-910b, fitted on torch_npu runs" in text and "tokens/s per device" in text
