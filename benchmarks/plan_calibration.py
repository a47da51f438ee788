"""`mm-train plan`'s throughput against MindSpeed-MM's published figures: the compute efficiency
fitted, each figure's error and the leave-one-out error, side by side.

    python benchmarks/plan_calibration.py

MindSpeed-MM publishes samples per second of its MindSpore backend on 1 x 8 Ascend NPUs in BF16
(docs/zh/mindspore/readme.md of github.com/Ascend/MindSpeed-MM, read at commit 57069cd5). Each
run below is planned with the layout and shapes of MindSpeed-MM's own example script for it
(examples/mindspore/..., same commit), on our built-in recipe of the family with the published
checkpoint's config.json (tests/mm_train/data/hub_configs.json):

    Wan2.1-T2V-1.3B pre-training  0.73 SPS   wan2.1/1.3b/t2v/pretrain.sh: DP8, micro-batch 1,
                                             global batch 8, block recompute of 20 of 30 layers,
                                             81 frames of 480 x 832, 512 text tokens
    Wan2.1-I2V-1.3B pre-training  0.61 SPS   wan2.1/1.3b/i2v/pretrain.sh: the same with all 30
                                             layers recomputed; pretrain_model.json: 36 input
                                             channels, CLIP image features of width 1280
    Qwen2.5-VL-7B fine-tuning    12.67 SPS   qwen2.5vl/finetune_qwen2_5_vl_7b.sh: TP1 PP2 (text
                                             layers 12 + 16, the whole vision tower on stage 0,
                                             frozen), micro-batch 1, global batch 192,
                                             distributed optimizer, no recompute; the published
                                             average sequence of 563 tokens, pictures of at most
                                             262144 pixels (data_7b.json)

    CogVideoX-T2V-5B pre-training 0.46 SPS   cogvideox/t2v_1.0/pretrain_cogvideox_t2v.sh (read at
                                             commit 8b199593, before the folder left the tree;
                                             the figure is that commit's readme): TP4 + SP, DP2,
                                             micro-batch 1, global batch 8 (4 accumulation
                                             steps), full recompute of the 42 blocks,
                                             distributed optimizer; data.json: 17 frames of
                                             480 x 720, 226 text tokens; model json:
                                             load_video_features / load_text_features false — the
                                             VAE and T5 encode every clip in the step (our
                                             data.online), the VAE untiled

Differences the plan cannot express: the Wan scripts shard parameters with ZeRO-3 (layerzero;
planned here as ZeRO-2, which moves the same gradient volume), and our pipeline recomputes each
stage's forward in its backward where MindSpeed-MM does not (a fourth pass in the plan of the
Qwen run: ours would be slower by it).

Compared, not fitted (planned with devices.yaml's constants as they are, on our real-size recipes,
which take MindSpeed-MM's layouts and shapes): its Wan2.2 figures on Atlas A3 (docs/zh/pytorch/
supported_models.md at commit 26adc742, column "NPU性能" (NPU performance), cluster throughput;
the table left that file in the next commit, d3e3485a), on our ascend-910c entry (one die of a
910C, devices.yaml says where its figures come from):

    Wan2.2-TI2V-5B pre-training   3.18 SPS   1 x 4 (A3) = 8 dies: examples/wan2.2/5B/ti2v/pretrain.sh,
                                             DP8 (FSDP2), micro-batch 1, every block recomputed,
                                             49 frames of 480 x 832, 512 text tokens
    Wan2.2-T2V-A14B pre-training  0.710 SPS  1 x 8 (A3) = 16 dies: examples/wan2.2/A14B/t2v/
                                             pretrain_high.sh, DP16 (FSDP2), one expert, the same
                                             recompute and shapes

Each plan's step is compute and bubble (both over the compute efficiency E), plus online
encoding (over its own efficiency E_e: the VAE's 3-D convolutions are not the matrix products E
measures), plus launch time (layer passes x P, the per-layer-pass cost beyond FLOPs), plus
communication (at devices.yaml's link efficiency): S = A / E + D / E_e + B P + C per run. E and P
are fitted by least squares of the log errors over a fine grid on the runs that do not encode,
E_e then on those that do (only the CogVideoX run: it sets E_e alone, so its leave-one-out error
takes E_e = E); a run's leave-one-out error is its error under the constants fitted on the others
(with the two DiT runs alone P is not determined: the smallest fitting P is taken).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HUB = json.loads((ROOT / "tests" / "mm_train" / "data" / "hub_configs.json").read_text())
T2V = "Wan2.1-T2V-1.3B-Diffusers/transformer"
# the 1.3B I2V DiT of MindSpeed-MM's pretrain_model.json: the T2V 1.3B with the I2V inputs
I2V_CONFIG = {**HUB[T2V], "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 1536}
WAN_SETS = ["parallel.cp=1", "parallel.zero_stage=2", "train.global_batch_size=8", "train.micro_batch_size=1",
            "model.recompute=block", "data.num_frames=81", "data.max_area=399360", "data.text_max_length=512"]
RUNS = [
    ("Wan2.1-T2V-1.3B pre-training", "wan2_1_t2v_1_3b", HUB[T2V], [*WAN_SETS, "model.recompute_num_layers=20"], 0.73),
    ("Wan2.1-I2V-1.3B pre-training", "wan2_1_t2v_1_3b", I2V_CONFIG, [*WAN_SETS, "model.recompute_num_layers=30"],
     0.61),
    ("CogVideoX-T2V-5B pre-training", "cogvideox_5b_t2v", HUB["CogVideoX-5b/transformer"],
     ["parallel.tp=4", "parallel.sequence_parallel=true", "parallel.zero_stage=1", "train.global_batch_size=8",
      "train.micro_batch_size=1", "model.recompute=full", "data.num_frames=17", "data.max_area=345600",
      "data.text_max_length=226", "data.online=true"], 0.46),
    ("Qwen2.5-VL-7B fine-tuning", "qwen2_5_vl_7b_sft", HUB["Qwen2.5-VL-7B-Instruct"],
     ["parallel.tp=1", "parallel.pp=2", "parallel.zero_stage=1",
      "train.global_batch_size=192", "train.micro_batch_size=1", "model.recompute=none", "model.freeze=[vision]",
      "data.max_length=563", "data.max_pixels=262144", "data.packing=false"], 12.67),  # the published run: unpacked
]


# Wan2.2 on Atlas A3, compared with the plan of our recipe of the same layout and shapes (not fitted)
COMPARED = [
    ("Wan2.2-TI2V-5B pre-training", "wan2_2_ti2v_5b", "Wan2.2-TI2V-5B-Diffusers", [], 3.18),
    ("Wan2.2-T2V-A14B pre-training", "wan2_2_t2v_a14b", "Wan2.2-T2V-A14B-Diffusers", [], 0.710),
]


def _pipeline_folder(key: str) -> str:
    """A diffusers pipeline folder of hub_configs.json's ``key``: its model_index.json and its
    components' config.json (tests/helpers/hub_folders.py writes them alike for the tests)."""
    folder = os.path.join(tempfile.mkdtemp(prefix="calibration_"), key)
    for name, content in [("model_index.json", HUB[key]["model_index.json"])] + [
            (f"{part}/config.json", HUB[f"{key}/{part}"]) for part in HUB[key]["model_index.json"]
            if f"{key}/{part}" in HUB]:
        os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
        with open(os.path.join(folder, name), "w") as f:
            json.dump(content, f)
    return folder


def compared(recipe_name: str, key: str, sets) -> dict:
    """The plan of a real-size recipe on its own cluster with the shipped constants."""
    from mm_train.plan import make_plan
    from mm_train.recipe import load_recipe

    return make_plan(load_recipe(recipe_name, [f"model.path={_pipeline_folder(key)}", *sets]))


def _folder(config: dict) -> str:
    folder = tempfile.mkdtemp(prefix="calibration_")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def step_parts(recipe_name: str, config: dict, sets) -> dict:
    """{compute (s at E = 1, bubble included), encode (s at E_e = 1), launch (s at P = 1 ms), communication (s),
    global_batch, device} of one run."""
    from mm_train.plan import cluster_of, load_devices, model_config, plan_on
    from mm_train.recipe import load_recipe

    recipe = load_recipe(recipe_name, [f"model.path={_folder(config)}", *sets])
    known = load_devices()
    known["efficiency"] = {**known["efficiency"], "compute": 1.0, "layer_pass_ms": 1.0, "encode": 1.0}
    cluster = cluster_of(recipe, 1, 8)
    plan = plan_on(recipe, cluster, known, model_config(recipe))
    parts = plan["breakdown"]
    compute = parts["compute"] + parts["bubble"]
    return {"compute": compute, "encode": parts["encode"], "launch": parts["launch"],
            "communication": plan["step_time_s"] - compute - parts["encode"] - parts["launch"],
            "global_batch": recipe.train.global_batch_size, "device": recipe.cluster.device}


def predicted_sps(parts: dict, efficiency: float, layer_pass_ms: float, encode_efficiency: float) -> float:
    return parts["global_batch"] / (parts["compute"] / efficiency + parts["encode"] / encode_efficiency +
                                    parts["launch"] * layer_pass_ms + parts["communication"])


def fit(parts, published):
    """(E, P in ms, E_e): least squares of log(predicted / published) over a grid of E 0.050 ..
    1.000 and P 0 .. 3 ms (the smallest P among equal fits) on the runs without encoding, then of
    E_e 0.005 .. 1.000 on the others (E_e = E when no run encodes)."""
    import numpy as np

    plain = [(p, sps) for p, sps in zip(parts, published) if not p["encode"]]
    encoding = [(p, sps) for p, sps in zip(parts, published) if p["encode"]]
    e = np.arange(50, 1001)[:, None] / 1000
    q = np.arange(0, 301)[None, :] / 100
    error = sum(np.log(p["global_batch"] / (p["compute"] / e + p["launch"] * q + p["communication"]) / sps) ** 2
                for p, sps in plain)
    i, j = np.unravel_index(np.argmin(error + q * 1e-12), error.shape)
    efficiency, layer_pass = float(e[i, 0]), float(q[0, j])
    if not encoding:
        return efficiency, layer_pass, efficiency
    grid = np.arange(5, 1001) / 1000
    error = sum(np.log(predicted_sps(p, efficiency, layer_pass, grid) / sps) ** 2 for p, sps in encoding)
    return efficiency, layer_pass, float(grid[np.argmin(error)])


def main():
    from mm_train.recipe import load_recipe

    parts = [step_parts(recipe, config, sets) for _, recipe, config, sets, _ in RUNS]
    published = [run[4] for run in RUNS]
    efficiency, layer_pass, encode = fit(parts, published)
    print(f"{'run (1 x 8, BF16)':<30} {'device':<13} {'published':>9} {'predicted':>9} {'error':>7} "
          f"{'leave-one-out':>13}")
    worst = worst_out = 0.0
    for i, (run, p) in enumerate(zip(RUNS, parts)):
        predicted = predicted_sps(p, efficiency, layer_pass, encode)
        others = fit([q for j, q in enumerate(parts) if j != i], [v for j, v in enumerate(published) if j != i])
        out = predicted_sps(p, *others)
        error, error_out = predicted / run[4] - 1, out / run[4] - 1
        worst, worst_out = max(worst, abs(error)), max(worst_out, abs(error_out))
        print(f"{run[0]:<30} {p['device']:<13} {run[4]:>9.3g} {predicted:>9.3g} {error:>+7.1%} {error_out:>+12.1%} "
              f"(E {others[0]:.3f}, P {others[1]:.2f} ms, E_e {others[2]:.3f})")
    print(f"fitted: compute efficiency {efficiency:.3f}, {layer_pass:.2f} ms per layer pass, online encoding "
          f"{encode:.3f} (devices.yaml efficiency.compute, layer_pass_ms, encode); worst error {worst:.1%}, worst "
          f"leave-one-out {worst_out:.1%} (goal <= 25%)")
    print(f"\n{'compared, not fitted (Atlas A3)':<32} {'NPUs':>5} {'published':>9} {'planned':>9} {'error':>7} "
          f"{'ZeRO':>4} {'peak GiB':>8}")
    for name, recipe, key, sets, sps in COMPARED:
        plan = compared(recipe, key, sets)
        zero = load_recipe(recipe).parallel.zero_stage
        print(f"{name:<32} {plan['devices']:>5} {sps:>9.3g} {plan['samples_per_s']:>9.3g} "
              f"{plan['samples_per_s'] / sps - 1:>+7.1%} {zero:>4} {plan['peak_bytes'] / 2 ** 30:>8.1f}")


if __name__ == "__main__":
    main()
