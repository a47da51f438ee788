"""`mm-train import llamafactory`: a training YAML in the shape of LLaMA-Factory's examples (written
here) becomes a recipe, checked field by field against the YAML, with what has no mm equivalent
listed; the same recipe on the tiny model trains two steps on two processes."""

import json

import pytest
import yaml
from helpers.hub_folders import write_hub_folder
from helpers.llamafactory_data import make_user_data
from helpers.mm_train_cli import losses, mm_train

from mm_train.importing import llamafactory
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
    # the tiny equivalent: the same recipe, the tiny default's model in place of the 7B folder
    values = yaml.safe_load(text)
    values["model"] = {**values["model"], "path": None, "config": load_recipe("qwen2_5_vl_tiny").model.config}
    values["data"].update(tokenizer=str(user_data / "tokenizer.json"), min_pixels=3136)
    values["train"].update(steps=2, log_every=1)  # the rest as imported: LoRA, ZeRO-2, the optimizer offloaded, bf16
    values["output_dir"] = str(tmp_path / "run")
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text(yaml.safe_dump(values))
    result = mm_train("run", str(tiny), "--nproc", "2", "--no-progress", data=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(losses(tmp_path / "run")) == 2
