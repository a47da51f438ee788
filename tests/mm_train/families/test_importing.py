"""`mm-train import llamafactory`: a training YAML in the shape of LLaMA-Factory's examples (written
here) becomes a recipe, checked field by field against the YAML, with what has no mm equivalent
listed; the same recipe on the tiny model trains two steps on two processes."""

import json

import pytest
import yaml
from helpers.hub_folders import write_hub_folder
from helpers.llamafactory_data import make_user_data
from helpers.mm_train_cli import losses, mm_train

from mm_train.families.importing import llamafactory
from mm_train.recipe import build_recipe, load_recipe


@pytest.fixture(scope="module")
def user_data(tmp_path_factory):
    return make_user_data(tmp_path_factory.mktemp("factory"))


def factory_yaml(root, model, **changes):
    """LLaMA-Factory's qwen2.5-VL LoRA SFT example's keys (examples/train_lora/*.yaml), our values."""
    (root / "ds_z2_offload.json").write_text(json.dumps({
        "train_batch_size": "auto", "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    args = {"model_name_or_path": str(model), "image_max_pixels": 6272, "video_max_pixels": 3136,
            "trust_remote_code": True, "stage": "sft", "do_train": True, "finetuning_type": "lora",
            "lora_rank": 16, "lora_target": "all", "deepspeed": "ds_z2_offload.json",
            "dataset": "pictures,clips", "dataset_dir": str(root), "template": "qwen2_vl", "cutoff_len": 512,
            "max_samples": 1000, "neat_packing": True, "overwrite_cache": True, "preprocessing_num_workers": 16,
            "output_dir": str(root / "saves"), "logging_steps": 10, "save_steps": 500, "plot_loss": True,
            "overwrite_output_dir": True, "report_to": "none", "per_device_train_batch_size": 1,
            "gradient_accumulation_steps": 2, "learning_rate": 1.0e-4, "num_train_epochs": 3.0,
            "lr_scheduler_type": "cosine", "warmup_ratio": 0.1, "bf16": True, "ddp_timeout": 180000000,
            "video_fps": 3.0, "video_maxlen": 64, "resume_from_checkpoint": None, **changes}
    path = root / "qwen2_5vl_lora_sft.yaml"
    path.write_text(yaml.safe_dump(args))
    return path


def test_a_lora_sft_yaml_becomes_a_checked_recipe_field_by_field(user_data, tmp_path):
    model = write_hub_folder(tmp_path / "Qwen2.5-VL-7B-Instruct", "Qwen2.5-VL-7B-Instruct")
    imported = llamafactory.import_config(factory_yaml(tmp_path, model, dataset_dir=str(user_data)), nproc=2)
    r = imported.recipe
    assert r["model"] == {"family": "qwen2_5_vl", "path": model, "lora": {"r": 16, "alpha": 32.0, "dropout": 0.0},
                          "freeze": ["vision", "merger"]}  # LLaMA-Factory freezes the tower and projector by default
    assert r["data"] == {"max_pixels": 6272, "video_fps": 3.0, "kind": "llamafactory", "dataset_info": str(user_data),
                         "dataset": ["pictures", "clips"], "max_length": 512, "packing": True}
    # 10 + 5 samples, 3 epochs, 1 x 2 x 2 per step: 12 steps (the data set counted as LLaMA-Factory would)
    assert r["train"] == {"micro_batch_size": 1, "global_batch_size": 4, "steps": 12, "seed": 42,
                          "precision": "bf16", "log_every": 10}
    assert r["optim"] == {"lr": 1e-4, "lr_schedule": "cosine", "warmup_steps": 1, "decay_steps": 12, "min_lr": 0.0,
                          "weight_decay": 0.0, "clip_grad": 1.0, "betas": [0.9, 0.999], "eps": 1e-8,
                          "offload": "optimizer"}
    assert r["parallel"] == {"zero_stage": 2} and r["checkpoint"] == {"every": 500}
    assert r["output_dir"] == str(tmp_path / "saves")
    left = dict(imported.left_out)
    assert set(left) == {"video_max_pixels: 3136", "video_maxlen: 64", "max_samples: 1000"}, left
    assert {"template", "trust_remote_code", "do_train"} <= set(imported.not_needed)  # named, not silently dropped
    recipe = build_recipe(r)  # mm's own checks
    assert recipe.model.lora.r == 16 and recipe.optim.offload == "optimizer" and recipe.data.packing


def test_what_has_no_equivalent_is_listed_or_refused(user_data, tmp_path):
    model = write_hub_folder(tmp_path / "Qwen3-VL-8B-Instruct", "Qwen3-VL-8B-Instruct")
    path = factory_yaml(tmp_path, model, dataset_dir=str(user_data), neat_packing=False, packing=True,
                        finetuning_type="full", freeze_vision_tower=False, stage="dpo", pref_beta=0.2,
                        pref_loss="ipo", report_to=["wandb", "neptune"], lr_scheduler_type="polynomial",
                        deepspeed="missing.json", galore_rank=16)
    imported = llamafactory.import_config(path, nproc=1)
    r, left = imported.recipe, dict(imported.left_out)
    assert r["model"]["family"] == "qwen3_vl" and "lora" not in r["model"] and r["model"]["freeze"] == ["merger"]
    assert r["train"]["objective"] == "dpo" and r["dpo"] == {"method": "ipo", "beta": 0.2, "label_smoothing": 0.0,
                                                              "sft_weight": 0.0}
    assert r["logging"] == {"wandb": {}} and r["optim"]["lr_schedule"] == "cosine"
    for key in ("packing: true", "report_to: neptune", "lr_scheduler_type: polynomial", "deepspeed: missing.json",
                "galore_rank: 16"):
        assert key in left, (key, left)
    assert "attend to each other" in left["packing: true"]
    with pytest.raises(ValueError, match="stage 'ppo'"):
        llamafactory.import_config(factory_yaml(tmp_path, model, dataset_dir=str(user_data), stage="ppo"))
    with pytest.raises(ValueError, match="names no family mm trains"):
        llamafactory.import_config(factory_yaml(tmp_path, tmp_path / "llava-1.5-7b", dataset_dir=str(user_data)))


def test_the_command_writes_the_recipe_and_it_trains_on_two_processes(user_data, tmp_path):
    model = write_hub_folder(tmp_path / "Qwen2.5-VL-7B-Instruct", "Qwen2.5-VL-7B-Instruct")
    out = tmp_path / "recipe.yaml"
    result = mm_train("import", "llamafactory", str(factory_yaml(tmp_path, model, dataset_dir=str(user_data))),
                      "--nproc", "2", "-o", str(out), data=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "not carried over: video_maxlen: 64: mm samples every clip" in result.stderr
    text = out.read_text()
    assert text.startswith("# Imported by `mm-train import llamafactory` from ") and "#   max_samples: 1000" in text
    # the rest as imported: LoRA, ZeRO-2, the optimizer offloaded, bf16, packing
    values = yaml.safe_load(text)
    values["data"]["min_pixels"] = 3136
    values["train"]["log_every"] = 1
    train_tiny_equivalent(values, tmp_path, tokenizer=str(user_data / "tokenizer.json"))


def on_built_in_set(imported, kind):
    """The written recipe's values with a built-in data set of ``kind`` in place of the source's data,
    a global batch of 2 and no cluster section (2 local processes)."""
    values = yaml.safe_load(imported.yaml_text())
    values["data"] = {"kind": kind, "samples": 8}
    values["train"]["global_batch_size"] = 2
    values.pop("cluster", None)
    return values


def train_tiny_equivalent(values, tmp_path, tiny="qwen2_5_vl_tiny", **data):
    """The imported recipe with a tiny recipe's model in place of the real-size folder (and ``data``
    set) trains two steps on two processes."""
    values["model"] = {**values["model"], "path": None, "config": load_recipe(tiny).model.config}
    values["data"].update(data)
    values["train"]["steps"] = 2
    values["output_dir"] = str(tmp_path / "run")
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(values))
    result = mm_train("run", str(path), "--nproc", "2", "--no-progress", data=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(losses(tmp_path / "run")) == 2


# -- MindSpeed-MM --------------------------------------------------------------------------------

def test_the_shell_reader_evaluates_assignments_and_arithmetic_as_bash_does():
    from mm_train.families.importing.shell import UNKNOWN, arithmetic, flags, read_script, words

    assert arithmetic("$A*($B+1)/3 % 5", {"A": "4", "B": "2"}) == 4 and arithmetic("-X + 7", {}) == 7
    with pytest.raises(ValueError, match="not an integer"):
        arithmetic("$A*2", {"A": "two"})
    assert words('run "$A b" ${B:-x}$A 2>&1 > log.txt \'$A\'', {"A": "1 2"}) == ["run", "1 2 b", "x1", "2", "$A"]
    script = read_script('''#!/bin/bash
# a comment
export N=8; NODES=2
WORLD=$(($N*$NODES))
STAMP=$(date +%s)
ARGS="
    --tensor-model-parallel-size 2 \\
    --lr 1e-5 \\
    --stamp $STAMP \\
"
msrun --worker_num $WORLD --local_worker_num $N train.py $ARGS --bf16 --tag a b 2>&1 | tee out.log
''')
    assert script.variables["WORLD"] == "16" and script.program == "train.py"
    assert script.launcher == ["msrun", "--worker_num", "16", "--local_worker_num", "8"]
    found = flags(script.args)
    assert found["tensor-model-parallel-size"] == "2" and found["bf16"] is True and found["tag"] == "a b"
    assert UNKNOWN in found["stamp"]


def mindspeed_files(root, data_root, model_folder, attr=None, **gpt):
    """A Qwen2.5-VL launch script and its model / data JSON in the shapes of MindSpeed-MM's
    examples/mindspore/qwen2.5vl (written here): TP=1 PP=2 MBS=1 GRAD_ACC_STEP=48 on 8 NPUs."""
    flags = {"tensor-model-parallel-size": "${TP}", "pipeline-model-parallel-size": "${PP}",
             "context-parallel-size": "${CP}", "context-parallel-algo": "ulysses_cp_algo",
             "micro-batch-size": "${MBS}", "global-batch-size": "${GBS}", "tokenizer-type": "NullTokenizer",
             "seq-length": "1024", "lr": "1.0e-5", "lr-decay-style": "cosine", "weight-decay": "0",
             "train-iters": "10000", "lr-warmup-fraction": "0.1", "clip-grad": "0.0", "adam-beta1": "0.9",
             "adam-beta2": "0.999", "seed": "42", "bf16": "", "load": "$LOAD_PATH", "use-flash-attn": "",
             "use-distributed-optimizer": "", "recompute-granularity": "full", "recompute-method": "block",
             "recompute-num-layers": "4", "num-workers": "8", **gpt}
    lines = "".join(f"    --{k} {v} \\\n" for k, v in flags.items())
    (root / "finetune_qwen2_5_vl_7b.sh").write_text(f'''#!/bin/bash
source /usr/local/Ascend/cann/set_env.sh
export HCCL_CONNECT_TIMEOUT=1200
NPUS_PER_NODE=8
MASTER_ADDR=localhost
MASTER_PORT=6000
NNODES=1
NODE_RANK=0
WORLD_SIZE=$(($NPUS_PER_NODE*$NNODES))
MM_DATA="./data_7b.json"
MM_MODEL="./model_7b.json"
LOAD_PATH="ckpt/mm_path/Qwen2.5-VL-7B-Instruct"
TP=1
PP=2
CP=1
MBS=1
GRAD_ACC_STEP=48
DP=$(($WORLD_SIZE/$TP/$PP/$CP))
GBS=$(($MBS*$GRAD_ACC_STEP*$DP))
DISTRIBUTED_ARGS="
    --local_worker_num $NPUS_PER_NODE \\
    --worker_num $WORLD_SIZE \\
    --node_rank $NODE_RANK \\
    --master_addr $MASTER_ADDR \\
    --master_port $MASTER_PORT \\
    --join True \\
"
GPT_ARGS="
{lines}"
MM_ARGS="
    --mm-data $MM_DATA \\
    --mm-model $MM_MODEL
"
OUTPUT_ARGS="
    --log-interval 1 \\
    --save-interval 5000 \\
    --save save_dir \\
"
logfile=$(date +%Y%m%d)_$(date +%H%M%S)
msrun $DISTRIBUTED_ARGS pretrain_vlm.py \\
    $GPT_ARGS \\
    $MM_ARGS \\
    $OUTPUT_ARGS \\
    --distributed-backend nccl \\
    --ai-framework mindspore \\
    2>&1 | tee logs/train_${{logfile}}.log
''')
    (root / "model_7b.json").write_text(json.dumps({
        "model_id": "qwen2_5vl", "image_encoder": {
            "vision_encoder": {"model_id": "qwen2vit", "num_layers": 32, "freeze": True,
                               "pipeline_num_layers": [32, 0]},
            "vision_projector": {"model_id": "lnmlp", "freeze": False}},
        "text_decoder": {"model_id": "qwen2_5_lm", "num_layers": 28, "pipeline_num_layers": [12, 16]}}))
    default = {"system": None, "images": "images", "videos": "videos", "messages": "messages", "role_tag": "role",
               "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
    (root / "data_7b.json").write_text(json.dumps({"dataset_param": {
        "dataset_type": "huggingface",
        "preprocess_parameters": {"model_name_or_path": str(model_folder), "image_max_pixels": 6272,
                                  "image_min_pixels": 3136, "video_max_pixels": 16384, "video_fps": 3.0,
                                  "video_maxlen": 64},
        "basic_parameters": {"template": "qwen2vl", "dataset_dir": str(data_root),
                             "dataset": str(data_root / "sft.json"), "cutoff_len": 512},
        "attr": attr or default}}))
    return root / "finetune_qwen2_5_vl_7b.sh"


def test_a_mindspeed_script_becomes_a_recipe_whose_plan_has_its_layout(user_data, tmp_path):
    from mm_train.families.importing import mindspeed
    from mm_train.plan import make_plan

    model = write_hub_folder(tmp_path / "Qwen2.5-VL-7B-Instruct", "Qwen2.5-VL-7B-Instruct")
    imported = mindspeed.import_script(mindspeed_files(tmp_path, user_data, model), beside=tmp_path / "out")
    r = imported.recipe
    assert imported.world_size == 8 and r["cluster"] == {"nodes": 1, "devices_per_node": 8,
                                                         "device": "ascend-910b2"}
    assert r["model"] == {"family": "qwen2_5_vl", "freeze": ["vision"], "path": model, "recompute": "block",
                          "recompute_num_layers": 4}
    assert r["parallel"] == {"tp": 1, "pp": 2, "cp": 1, "zero_stage": 1, "pp_layers": [12, 16]}
    assert r["train"] == {"micro_batch_size": 1, "global_batch_size": 192, "steps": 10000, "seed": 42,
                          "precision": "bf16"}  # GBS = MBS x GRAD_ACC_STEP x DP = 1 x 48 x 4
    assert r["optim"] == {"lr": 1e-5, "min_lr": 0.0, "lr_schedule": "cosine", "warmup_steps": 1000,
                          "decay_steps": 10000, "weight_decay": 0.0, "clip_grad": 0.0, "betas": [0.9, 0.999],
                          "eps": 1e-8}
    assert r["data"] == {"kind": "llamafactory", "max_pixels": 6272, "min_pixels": 3136, "video_fps": 3.0,
                         "max_length": 512, "path": str(user_data / "sft.json"), "media_dir": str(user_data)}
    assert r["checkpoint"] == {"every": 5000} and r["output_dir"] == "save_dir"
    left = dict(imported.left_out)
    assert set(left) == {"video_max_pixels: 16384", "video_maxlen: 64",
                         "--load ckpt/mm_path/Qwen2.5-VL-7B-Instruct"}, left
    assert {"--use-flash-attn", "--tokenizer-type", "--ai-framework"} <= set(imported.not_needed)
    assert "# Read, not needed by mm (the other tool's own machinery): " in imported.yaml_text()
    plan = make_plan(build_recipe(r))  # on the script's 1 x 8 Atlas 800T A2 (910B2)
    assert plan["fits"] and plan["devices"] == 8 and {rank["pp_stage"] for rank in plan["ranks"]} == {0, 1}, plan
    # the uneven split [12, 16] moves two of the 28 text layers from the first stage to the second against [14, 14]
    even = make_plan(build_recipe({**r, "parallel": {**r["parallel"], "pp_layers": None}}))
    params = [{rank["pp_stage"]: rank["params"] for rank in p["ranks"]} for p in (plan, even)]
    moved = params[0][1] - params[1][1]
    assert moved > 0 and params[1][0] - params[0][0] == moved and moved % 2 == 0
    assert plan["batch_samples"] == 192


def test_renamed_columns_become_a_dataset_info_and_unknown_flags_are_listed(user_data, tmp_path):
    from mm_train.families.importing import mindspeed

    model = write_hub_folder(tmp_path / "Qwen2.5-VL-7B-Instruct", "Qwen2.5-VL-7B-Instruct")
    attr = {"images": "pics", "messages": "chat", "role_tag": "who", "content_tag": "says", "user_tag": "asker",
            "assistant_tag": "answerer", "system_tag": None}
    script = mindspeed_files(tmp_path, user_data, model, attr=attr, **{"swap-attention": "", "lr-decay-style": "WSD"})
    (user_data / "renamed.json").write_text((user_data / "pictures.json").read_text())
    data = json.loads((tmp_path / "data_7b.json").read_text())
    data["dataset_param"]["basic_parameters"]["dataset"] = str(user_data / "renamed.json")
    (tmp_path / "data_7b.json").write_text(json.dumps(data))
    imported = mindspeed.import_script(script, beside=tmp_path / "out")
    info = json.loads((tmp_path / "out" / "dataset_info.json").read_text())
    assert info == {"set0": {"file_name": str(user_data / "renamed.json"), "formatting": "sharegpt",
                             "columns": {"images": "pics", "messages": "chat"},
                             "tags": {"role_tag": "who", "content_tag": "says", "user_tag": "asker",
                                      "assistant_tag": "answerer"}}}
    assert imported.recipe["data"]["dataset_info"] == str(tmp_path / "out")
    left = dict(imported.left_out)
    assert "--swap-attention" in left and "--lr-decay-style WSD" in left


def test_a_wan_script_reads_its_pipeline_folder_and_names_the_feature_set(tmp_path):
    from mm_train.families.importing import mindspeed

    (tmp_path / "pretrain_model.json").write_text(json.dumps({
        "task": "t2v", "predictor": {"model_id": "wandit", "num_layers": 30, "pipeline_num_layers": [15, 15]}}))
    (tmp_path / "feature_data.json").write_text(json.dumps({"dataset_param": {
        "dataset_type": "feature", "basic_parameters": {"data_path": "./sora_features/data.jsonl"},
        "preprocess_parameters": {"num_frames": 81, "max_hxw": 399360, "train_fps": 16},
        "tokenizer_config": [{"from_pretrained": "Wan2.1-T2V-1.3B-Diffusers/tokenizer", "model_max_length": 512}]}}))
    (tmp_path / "pretrain.sh").write_text('''
NPUS_PER_NODE=8; NNODES=2; WORLD_SIZE=$(($NPUS_PER_NODE*$NNODES))
TP=1; PP=2; CP=2; MBS=1; GRAD_ACC_STEP=2; DP=$(($WORLD_SIZE/$TP/$PP/$CP)); GBS=$(($MBS*$GRAD_ACC_STEP*$DP))
torchrun --nproc_per_node $NPUS_PER_NODE --nnodes $NNODES pretrain_sora.py --tensor-model-parallel-size $TP \\
  --pipeline-model-parallel-size $PP --context-parallel-size $CP --context-parallel-algo megatron_cp_algo \\
  --micro-batch-size $MBS --global-batch-size $GBS --lr 1e-5 --lr-decay-style constant --train-iters 5000 \\
  --mm-data feature_data.json --mm-model pretrain_model.json --load ./weights/Wan2.1-T2V-1.3B-Diffusers/transformer/
''')
    imported = mindspeed.import_script(tmp_path / "pretrain.sh")
    r = imported.recipe
    assert imported.world_size == 16 and r["cluster"] == {"nodes": 2, "devices_per_node": 8,
                                                          "device": "ascend-910b2"}
    assert r["model"] == {"family": "wan", "path": "weights/Wan2.1-T2V-1.3B-Diffusers"}
    assert r["parallel"] == {"tp": 1, "pp": 2, "cp": 2, "cp_algo": "ring"} and r["train"]["global_batch_size"] == 8
    assert r["data"] == {"kind": "video", "num_frames": 81, "max_area": 399360, "fps": 16.0, "text_max_length": 512,
                         "tokenizer": "Wan2.1-T2V-1.3B-Diffusers/tokenizer"}
    left = dict(imported.left_out)
    assert "torch pickles" in left["feature data set ./sora_features/data.jsonl"] and "model JSON task: t2v" in left
    # the tiny equivalent on 2 processes: the script's ring context parallelism (its pp2 x cp2 needs 4),
    # the built-in clips in place of the feature set mm cannot read
    values = on_built_in_set(imported, "tiny_video")
    values["parallel"]["pp"] = 1
    train_tiny_equivalent(values, tmp_path, tiny="wan2_1_t2v_tiny")


def test_the_mindspeed_command_writes_a_recipe_that_trains_with_its_pipeline_on_two_processes(user_data, tmp_path):
    model = write_hub_folder(tmp_path / "Qwen2.5-VL-7B-Instruct", "Qwen2.5-VL-7B-Instruct")
    out = tmp_path / "out" / "recipe.yaml"
    result = mm_train("import", "mindspeed", str(mindspeed_files(tmp_path, user_data, model)), "-o", str(out),
                      data=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    # the script's layout (pp 2 with its uneven split, ZeRO-1, block recomputation) on 2 processes equals one
    # process: the tiny model with 3 text layers cut [2, 1], in fp32 (bf16's rounding is compared elsewhere)
    values = yaml.safe_load(out.read_text())
    assert values["parallel"]["pp_layers"] == [12, 16] and "pipeline_num_layers" not in result.stderr
    tiny = load_recipe("qwen2_5_vl_tiny").model.config
    values["model"] = {**values["model"], "path": None, "recompute_num_layers": 1,
                       "config": {**tiny, "text_config": {**tiny["text_config"], "num_hidden_layers": 3}}}
    values["parallel"]["pp_layers"] = [2, 1]
    values["data"].update(max_bad_fraction=0.2, tokenizer=str(user_data / "tokenizer.json"))  # sft.json's one bad entry
    values["train"].update(global_batch_size=4, steps=2, precision="fp32")
    values["cluster"] = {"nodes": 1, "devices_per_node": 2}
    runs = {"pp2": (values, 2), "single": ({**values, "parallel": {**values["parallel"], "pp": 1, "pp_layers": None}},
                                           1)}
    for name, (run_values, nproc) in runs.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**run_values, "output_dir": str(tmp_path / name)}))
        result = mm_train("run", str(path), "--nproc", str(nproc), "--no-progress", data=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
    assert losses(tmp_path / "pp2") == pytest.approx(losses(tmp_path / "single"), rel=1e-4)
    assert len(losses(tmp_path / "single")) == 2


def test_a_yaml_configured_script_with_lora_and_a_hostfile_node_count(user_data, tmp_path):
    """MindSpeed-MM's transformers-backend scripts (Qwen3-VL): torchrun with a YAML whose gpt_args,
    lora_args, data and model sections hold what the JSON and flags hold elsewhere; FSDP2 as ZeRO-3;
    the node count read from a hostfile (never run) given with --var."""
    model = write_hub_folder(tmp_path / "Qwen3-VL-30B-A3B-Instruct", "Qwen3-VL-30B-A3B-Instruct")
    (tmp_path / "qwen3vl_lora_sft_30B.yaml").write_text(yaml.safe_dump({
        "gpt_args": {"context_parallel_size": 1, "use_torch_fsdp2": True, "micro_batch_size": 1,
                     "global_batch_size": 16, "lr": 1.0e-5, "lr_decay_style": "cosine", "lr_warmup_fraction": 0.1,
                     "train_iters": 1000, "seed": 42, "bf16": True, "use_flash_attn": True,
                     "no_load_optim": True, "load": "./ckpt/mm_path/Qwen3-VL-30B", "save": "save_dir"},
        "lora_args": {"lora_r": 8, "lora_alpha": 16, "lora_target_modules": "linear_qkv,linear_proj"},
        "data": {"dataset_param": {"preprocess_parameters": {"model_name_or_path": model},
                                   "basic_parameters": {"dataset": str(user_data / "sft.json"), "cutoff_len": 256},
                                   "attr": {"images": "images", "messages": "messages"}}},
        "model": {"model_id": "qwen3_vl_moe", "init_from_hf_path": model,
                  "image_encoder": {"vision_encoder": {"freeze": True}}}}))
    (tmp_path / "finetune_lora_qwen3vl_30B.sh").write_text('''
NPUS_PER_NODE=8
NNODES=$(wc -l < $HOSTFILE)
WORLD_SIZE=$(($NPUS_PER_NODE * $NNODES))
config_path=qwen3vl_lora_sft_30B.yaml
DISTRIBUTED_ARGS="--nproc_per_node $NPUS_PER_NODE --nnodes $NNODES --node_rank 0"
torchrun $DISTRIBUTED_ARGS pretrain_transformers.py ${config_path} 2>&1 | tee logs/train_$(date +%s).log
''')
    from mm_train.families.importing import mindspeed

    script = tmp_path / "finetune_lora_qwen3vl_30B.sh"
    imported = mindspeed.import_script(script, variables={"NNODES": "2"})
    r = imported.recipe
    assert imported.world_size == 16 and r["model"]["family"] == "qwen3_vl_moe" and r["model"]["path"] == model
    assert r["model"]["lora"] == {"r": 8, "alpha": 16.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    assert r["parallel"] == {"cp": 1, "zero_stage": 3} and r["model"]["freeze"] == ["vision"]
    assert r["train"]["global_batch_size"] == 16 and r["data"]["max_length"] == 256
    # the tiny equivalent on 2 processes: LoRA on the MoE model with its weights fully sharded (ZeRO-3)
    values = yaml.safe_load(imported.yaml_text())
    values["data"].update(max_bad_fraction=0.2, min_pixels=3136, max_pixels=6272)
    values["train"]["global_batch_size"] = 4
    values.pop("cluster")
    train_tiny_equivalent(values, tmp_path, tiny="qwen3_vl_moe_tiny", tokenizer=str(user_data / "tokenizer.json"))
    # without --var the node count is unknown, and the error says how to give it
    result = mm_train("import", "mindspeed", str(script), data=tmp_path)
    assert result.returncode == 2 and "NNODES comes from a command substitution" in result.stderr
    assert "--var NNODES=VALUE" in result.stderr


def test_a_cogvideox_lora_script_names_its_encoders_and_what_it_still_needs(tmp_path):
    """CogVideoX 1.5 LoRA (MindSpeed-MM's examples/cogvideox/*_1.5 shapes): SAT's fused projection as
    diffusers' to_q / to_k / to_v, the T5 folder and tokenizer kept, the torch VAE pickle and the
    converted checkpoint listed, and the check names what the recipe still needs."""
    from mm_train.families.importing import checked, mindspeed

    (tmp_path / "model_cogvideox_t2v_1.5.json").write_text(json.dumps({
        "frames": 37, "task": "t2v", "enable_encoder_dp": True,
        "predictor": {"model_id": "satdit", "num_layers": 42},
        "text_encoder": {"model_id": "T5", "from_pretrained": "5b-cogvideo"},
        "ae": {"model_id": "contextparallelcasualvae", "from_pretrained": "3d-vae.pt"}}))
    (tmp_path / "data.json").write_text(json.dumps({"dataset_param": {
        "dataset_type": "t2v", "basic_parameters": {"data_path": "/data_path/data.jsonl"},
        "preprocess_parameters": {"train_fps": 8, "num_frames": 37, "max_height": 480, "max_width": 720},
        "tokenizer_config": {"from_pretrained": "5b-cogvideo/tokenizer", "model_max_length": 226}}}))
    (tmp_path / "finetune_cogvideox_lora_t2v_1.5.sh").write_text('''
GPUS_PER_NODE=8; WORLD_SIZE=$(($GPUS_PER_NODE * 1)); TP=1; PP=1; CP=1; MBS=1; GRAD_ACC_STEP=1
GBS=$(($MBS*$GRAD_ACC_STEP*$WORLD_SIZE/$TP/$PP/$CP))
torchrun --nproc_per_node $GPUS_PER_NODE --nnodes 1 pretrain_sora.py --tensor-model-parallel-size ${TP} \\
    --micro-batch-size ${MBS} --global-batch-size ${GBS} --lr 1e-5 --lr-decay-style constant --train-iters 1000 \\
    --lora-r 128 --lora-alpha 64 --lora-target-modules proj_qkv to_out.0 --qk-layernorm --allow-tf32 --bf16 \\
    --mm-data data.json --mm-model model_cogvideox_t2v_1.5.json --load your_converted_dit_ckpt_dir
''')
    imported = mindspeed.import_script(tmp_path / "finetune_cogvideox_lora_t2v_1.5.sh")
    r = imported.recipe
    assert r["model"] == {"family": "cogvideox",
                          "lora": {"r": 128, "alpha": 64.0, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}}
    assert r["data"] == {"text_encoder": "5b-cogvideo", "kind": "video", "num_frames": 37, "max_area": 345600,
                         "fps": 8.0, "text_max_length": 226, "tokenizer": "5b-cogvideo/tokenizer",
                         "path": "/data_path/data.jsonl", "online": True, "encoder_dp": True}
    assert r["train"]["global_batch_size"] == 8 and r["train"]["precision"] == "bf16"
    left = dict(imported.left_out)
    assert set(left) == {"ae.from_pretrained: 3d-vae.pt", "model JSON task: t2v",
                         "--load your_converted_dit_ckpt_dir"}, left
    with pytest.raises(ValueError, match="model needs a path"):
        checked(imported)


def test_an_omni_script_freezes_its_towers_as_its_model_json_says_and_trains(user_data, tmp_path):
    from mm_train.families.importing import mindspeed

    model = write_hub_folder(tmp_path / "Qwen2.5-Omni-7B", "Qwen2.5-Omni-7B")
    script = mindspeed_files(tmp_path, user_data, model)
    (tmp_path / "model_7b.json").write_text(json.dumps({  # examples/mindspore/qwen2.5omni/model_7b.json's shape
        "model_id": "qwen2_5vl", "text_decoder": {"model_id": "qwen2_5_omni_thinker", "num_layers": 28,
                                                  "pipeline_num_layers": [14, 14]},
        "image_encoder": {"vision_encoder": {"freeze": True}, "vision_projector": {"freeze": True}},
        "audio_encoder": {"audio_encoder": {"model_id": "qwen_omni_audio", "freeze": True}}}))
    imported = mindspeed.import_script(script, beside=tmp_path / "out")
    assert imported.recipe["model"]["family"] == "qwen2_5_omni"
    assert imported.recipe["model"]["freeze"] == ["vision", "merger", "audio"]
    assert "pipeline_num_layers: [14, 14]" not in dict(imported.left_out)  # an even split is mm's own
    build_recipe(imported.recipe)
    # the tiny equivalent: the script's pp 2 with every tower frozen, on the built-in sounding set
    values = on_built_in_set(imported, "tiny_omni")
    values["model"]["recompute_num_layers"] = 1
    train_tiny_equivalent(values, tmp_path, tiny="qwen2_5_omni_tiny")


def test_a_cogvideox_scripts_tiny_equivalent_trains_with_its_tensor_parallelism(tmp_path):
    from mm_train.families.importing import mindspeed

    (tmp_path / "model.json").write_text(json.dumps({"predictor": {"model_id": "satdit", "num_layers": 42},
                                                     "enable_encoder_dp": True}))
    (tmp_path / "pretrain_cogvideox_t2v.sh").write_text('''
GPUS_PER_NODE=8; TP=2; MBS=1; GBS=$(($MBS*8/$TP))
torchrun --nproc_per_node $GPUS_PER_NODE --nnodes 1 pretrain_sora.py --tensor-model-parallel-size ${TP} \\
  --sequence-parallel --micro-batch-size ${MBS} --global-batch-size ${GBS} --lr 2e-4 --lr-decay-style cosine \\
  --lr-warmup-iters 1 --train-iters 100 --recompute-granularity full --recompute-method block \\
  --recompute-num-layers 42 --mm-model model.json
''')
    imported = mindspeed.import_script(tmp_path / "pretrain_cogvideox_t2v.sh")
    r = imported.recipe
    assert r["parallel"] == {"tp": 2, "sequence_parallel": True} and r["train"]["global_batch_size"] == 4
    assert r["model"] == {"family": "cogvideox", "recompute": "block", "recompute_num_layers": 42}
    assert r["data"] == {"online": True, "encoder_dp": True}  # each tp rank encodes its own micro-batches, gathered
    values = on_built_in_set(imported, "tiny_video")
    values["model"]["recompute_num_layers"] = 1  # of the tiny model's layers
    train_tiny_equivalent(values, tmp_path, tiny="cogvideox_t2v_tiny")
