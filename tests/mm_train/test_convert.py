"""`mm-train convert`: merged LoRA weights equal W + alpha / r * B A computed from the adapter file
(Qwen2.5-VL and Wan, loaded back by transformers / diffusers); a training checkpoint exports to a
folder transformers loads, its adapters merged."""

import json
import os

import numpy as np
import pytest
from helpers.mm_train_cli import mm_train
from safetensors.numpy import load_file


def _expected(base_state, adapters, alpha, r):
    """{module weight name: merged weight} from the adapter file, in numpy."""
    tensors = load_file(os.path.join(adapters, "adapter_model.safetensors"))
    merged = {}
    for key, a in tensors.items():
        if key.endswith("lora_A.weight"):
            module = key[len("base_model.model."):-len(".lora_A.weight")]
            b = tensors[key.replace("lora_A", "lora_B")]
            merged[f"{module}.weight"] = base_state[f"{module}.weight"] + (alpha / r) * (b @ a)
    return merged


def _check(base_state, merged_state, expected):
    assert set(merged_state) == set(base_state)
    for name, value in merged_state.items():
        if name in expected:
            np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(value, base_state[name], err_msg=name)


def test_merge_lora_qwen2_5_vl(tmp_path):
    from helpers.qwen_vl_reference import write_adapters, write_reference
    from transformers import Qwen2_5_VLForConditionalGeneration

    from mm_train.convert import merge_lora

    reference = write_reference(tmp_path / "base")
    (tmp_path / "base" / "tokenizer.json").write_text("{}")  # side files travel with the weights
    write_adapters(tmp_path / "adapters", reference, r=4, alpha=8.0)
    merge_lora(str(tmp_path / "base"), str(tmp_path / "adapters"), str(tmp_path / "merged"))
    base = {k: v.numpy() for k, v in reference.state_dict().items()}
    merged = {k: v.numpy() for k, v in Qwen2_5_VLForConditionalGeneration.from_pretrained(
        tmp_path / "merged").state_dict().items()}
    expected = _expected(base, tmp_path / "adapters", 8.0, 4)
    assert len(expected) == 2 * 7 + 2 * 3  # decoder layers: q k v o gate up down; vision blocks: gate up down
    _check(base, merged, expected)
    assert (tmp_path / "merged" / "tokenizer.json").exists()


def test_merge_lora_wan(tmp_path):
    from diffusers import WanTransformer3DModel
    from helpers.torch_reference import write_peft_adapters
    from helpers.wan_reference import write_reference

    from mm_models_video.wan.parallel_plan import LORA_TARGETS
    from mm_train.convert import merge_lora

    reference = write_reference(tmp_path / "base")
    write_peft_adapters(tmp_path / "adapters", reference, LORA_TARGETS, r=4, alpha=4.0)
    merge_lora(str(tmp_path / "base"), str(tmp_path / "adapters"), str(tmp_path / "merged"))
    base = {k: v.numpy() for k, v in reference.state_dict().items()}
    merged = {k: v.numpy() for k, v in WanTransformer3DModel.from_pretrained(tmp_path / "merged").state_dict().items()}
    expected = _expected(base, tmp_path / "adapters", 4.0, 4)
    assert len(expected) == 2 * 10  # two blocks x (attn1 q k v out, attn2 q k v out, ffn in, out)
    _check(base, merged, expected)


def _check_processing_files(folder, step, data):
    """The exported folder holds the run's tokenizer with its chat template and its processors'
    settings, as transformers loads them: the same ids and the same pixels as training used."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from mm_data.vl import Qwen2VLVideoProcessor, QwenChatTemplate
    from mm_train.families.vl.qwen2_5_vl import VLTask, vl_tokenizer
    from mm_train.recipe import load_recipe

    recipe = load_recipe(str(step / "recipe.json"))
    trained = vl_tokenizer(str(data / "tokenizer.json"))
    loaded = AutoTokenizer.from_pretrained(folder)
    assert loaded.chat_template == QwenChatTemplate(trained, recipe.data.system).jinja()
    caption = json.loads((data / "data.json").read_text())[0]["messages"][1]["content"]
    assert loaded(caption)["input_ids"] == trained(caption)["input_ids"]
    image, video = VLTask.processors(recipe.data)
    picture = np.random.default_rng(0).integers(0, 256, (70, 50, 3), dtype=np.uint8)
    got = AutoImageProcessor.from_pretrained(folder)([picture], return_tensors="np")
    assert np.array_equal(got["pixel_values"], image(picture)["pixel_values"])
    settings = json.loads((folder / "video_preprocessor_config.json").read_text())
    assert settings["processor_class"] == "Qwen2_5_VLProcessor"
    assert Qwen2VLVideoProcessor(**{k: v for k, v in settings.items() if not k.endswith(("_type", "_class"))}) \
        .to_dict() == video.to_dict()


@pytest.mark.distributed
def test_export_a_lora_training_checkpoint(tmp_path):
    from pathlib import Path

    from transformers import Qwen2_5_VLForConditionalGeneration

    import mm_train as package

    recipe = Path(package.__file__).with_name("recipes") / "qwen2_5_vl_tiny_lora.yaml"
    out = tmp_path / "lora"
    result = mm_train("run", str(recipe), "--set", "train.steps=2", "--set", "data.samples=32", "--set",
                      "checkpoint.every=2", "--set", f"output_dir={out}", "--no-progress", data=tmp_path / "data")
    assert result.returncode == 0, result.stderr[-3000:]
    step = out / "checkpoints" / "step_2"
    result = mm_train("convert", "checkpoint", str(step), str(tmp_path / "exported"), data=tmp_path / "data")
    assert result.returncode == 0 and "wrote" in result.stdout, result.stderr[-3000:]
    exported = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "exported").state_dict()
    base = Qwen2_5_VLForConditionalGeneration.from_pretrained(step / "model").state_dict()
    adapter = json.loads((step / "adapters" / "adapter_config.json").read_text())
    expected = _expected({k: v.numpy() for k, v in base.items()}, step / "adapters", adapter["lora_alpha"],
                         adapter["r"])
    _check({k: v.numpy() for k, v in base.items()}, {k: v.numpy() for k, v in exported.items()}, expected)
    _check_processing_files(tmp_path / "exported", step, tmp_path / "data")
    bad = mm_train("convert", "checkpoint", str(tmp_path), str(tmp_path / "x"), data=tmp_path / "data")
    assert bad.returncode == 2 and "not a complete training checkpoint" in bad.stderr
