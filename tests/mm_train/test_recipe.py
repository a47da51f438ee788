"""Recipes: typed sections, --set overrides read as YAML, unknown keys named with the closest
valid one, impossible layouts refused before any process starts."""

import json

import pytest

from mm_train.recipe import LoraSection, build_recipe, check_layout, load_recipe


def test_the_default_recipe_loads_and_overrides_apply():
    recipe = load_recipe(None, ["parallel.tp=2", "train.steps=4", "optim.betas=[0.9, 0.95]",
                                "checkpoint.every=3", "output_dir=/tmp/somewhere", "parallel.sequence_parallel=true"])
    assert recipe.parallel.tp == 2 and recipe.parallel.sequence_parallel is True
    assert recipe.train.steps == 4 and recipe.checkpoint.every == 3
    assert recipe.optim.betas == (0.9, 0.95) and recipe.output_dir == "/tmp/somewhere"
    assert recipe.model.family == "qwen2_5_vl" and recipe.model.config["text_config"]["hidden_size"] == 64


@pytest.mark.parametrize("overrides,message", [
    (["parallel.tpp=2"], "did you mean 'tp'"),
    (["trian.steps=2"], "did you mean 'train'"),
    (["optim.learning_rate=1"], "unknown optim key 'learning_rate'"),
    (["train.steps"], "section.key=value"),
    (["train.steps=0"], "train.steps must be >= 1"),
    (["parallel.sequence_parallel=true"], "sequence_parallel"),  # needs tp > 1: ParallelConfig's rule
    (["profile.start_stp=2"], "did you mean 'start_step'"),
    (["model.family=llama"], "not available"),
    (["train.loss_normalization=mean"], "train.loss_normalization must be token or sample"),
    (["data.max_tokens=0"], "the packed rows' token budget: set it >= 1"),
    (["train.global_batch_tokens=4096", "data.packing=false"], "does not pack: set data.packing: true"),
    (["train.global_batch_tokens=0"], "train.global_batch_tokens must be >= 1"),
    (["parallel.zero3_min_numel=0"], "zero3_min_numel must be a positive integer"),
])
def test_bad_recipes_are_refused_with_a_hint(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_recipe(None, overrides)


def test_zero3_needs_more_than_one_data_or_context_parallel_rank():
    recipe = load_recipe(None, ["parallel.zero_stage=3"])
    with pytest.raises(ValueError, match="leave one: run more processes or use zero_stage 0"):
        check_layout(recipe, 1)
    assert check_layout(recipe, 2) == 1 and check_layout(load_recipe(None, ["parallel.zero_stage=3", "parallel.cp=2"]),
                                                         2) == 2
    hybrid = ["parallel.zero3_shard=node", "parallel.ranks_per_node=2"]
    with pytest.raises(ValueError, match="needs parallel.zero_stage 3, not 0"):
        check_layout(load_recipe(None, hybrid), 4)
    with pytest.raises(ValueError, match="nothing would be sharded; use zero3_shard=all"):
        check_layout(load_recipe(None, hybrid + ["parallel.zero_stage=3", "parallel.tp=2"]), 4)
    assert check_layout(load_recipe(None, hybrid + ["parallel.zero_stage=3"]), 2) == 1
    with pytest.raises(ValueError, match="zero3_shard='nodes' is unknown; use all or node"):
        load_recipe(None, ["parallel.zero3_shard=nodes"])


def test_a_step_counts_samples_or_tokens():
    """Unset, a step is 8 samples; with train.global_batch_tokens its rows' number is free (one
    micro-batch is what check_layout can promise); a video recipe, which does not pack, refuses it."""
    assert load_recipe(None).train.global_batch_size == 8
    recipe = load_recipe(None, ["train.global_batch_tokens=4096"])
    assert recipe.train.global_batch_size is None and check_layout(recipe, 2) == 1
    assert build_recipe(recipe.to_dict()).train == recipe.train  # as recipe.json keeps it
    assert load_recipe("qwen3_vl_tiny", ["train.global_batch_tokens=512"]).train.global_batch_size is None
    with pytest.raises(ValueError, match="not both"):
        build_recipe({**recipe.to_dict(), "train": {"global_batch_size": 8, "global_batch_tokens": 512}})
    with pytest.raises(ValueError, match="does not pack"):
        load_recipe("wan2_1_i2v_tiny", ["train.global_batch_tokens=4096"])


def test_unknown_section_in_a_file(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("modle: {}\n")
    with pytest.raises(ValueError, match="did you mean 'model'"):
        load_recipe(str(path))
    with pytest.raises(FileNotFoundError):
        load_recipe(str(tmp_path / "missing.yaml"))


def test_layouts_the_world_or_the_batch_cannot_hold_are_refused():
    recipe = load_recipe(None, ["parallel.tp=2"])
    with pytest.raises(ValueError, match="cannot hold tp x cp x pp"):
        check_layout(recipe, 3)
    assert check_layout(recipe, 2) == 2  # dp 1: 8 samples = 2 micro-batches of 4
    assert check_layout(build_recipe({**recipe.to_dict(), "parallel": {}}), 2) == 1  # dp 2
    with pytest.raises(ValueError, match="multiple of micro_batch_size x dp"):
        check_layout(load_recipe(None, ["train.global_batch_size=6"]), 2)
    assert check_layout(load_recipe(None, ["parallel.pp=2"]), 2) == 2
    assert check_layout(load_recipe(None, ["parallel.pp=2", "parallel.vpp=2"]), 2) == 2
    with pytest.raises(ValueError, match="multiple of pp=2"):
        check_layout(load_recipe(None, ["parallel.pp=2", "parallel.vpp=2", "train.global_batch_size=4"]), 2)


def test_nested_overrides_reach_into_mapping_fields():
    recipe = load_recipe(None, ["model.config.text_config.num_hidden_layers=4", "model.lora.r=4"])
    assert recipe.model.config["text_config"]["num_hidden_layers"] == 4
    assert recipe.model.config["text_config"]["hidden_size"] == 64  # the rest of the mapping stays
    assert recipe.model.lora == LoraSection(r=4)  # typed, the family's defaults for the rest
    assert recipe.model.lora.options() == {"r": 4, "alpha": 16.0, "dropout": 0.0}
    with pytest.raises(ValueError, match="unknown model.lora key 'alfa'; did you mean 'alpha'"):
        load_recipe(None, ["model.lora.alfa=4"])
    with pytest.raises(ValueError, match="train.steps is not a mapping"):
        load_recipe(None, ["train.steps.x=4"])


def test_values_are_typed():
    recipe = load_recipe(None, ["optim.lr=1e-3", "train.steps=1e2"])
    assert recipe.optim.lr == 1e-3 and recipe.train.steps == 100 and isinstance(recipe.train.steps, int)
    with pytest.raises(ValueError, match="optim.lr must be a float"):
        load_recipe(None, ["optim.lr=fast"])
    with pytest.raises(ValueError, match="train.steps must be a int"):
        load_recipe(None, ["train.steps=2.5"])


def test_a_file_may_write_exponents_and_a_saved_recipe_json_loads_back(tmp_path):
    """YAML 1.1 reads ``1e-8`` (no dot) as a string: number fields take it as the number; a
    checkpoint's recipe.json (JSON writes 1e-08) loads back to the same recipe."""
    import yaml

    from mm_train import registry

    values = yaml.safe_load(registry.default_recipe().read_text())
    values.setdefault("optim", {}).update(yaml.safe_load("eps: 1e-8\nlr: 3E-4"))
    assert values["optim"]["eps"] == "1e-8"  # what PyYAML makes of it
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(values).replace("'1e-8'", "1e-8"))
    recipe = load_recipe(str(tmp_path / "r.yaml"))
    assert recipe.optim.eps == 1e-8 and recipe.optim.lr == 3e-4
    (tmp_path / "recipe.json").write_text(json.dumps(recipe.to_dict(), default=str))
    assert load_recipe(str(tmp_path / "recipe.json")).to_dict() == recipe.to_dict()


SHIPPED = {"qwen2_5_vl_tiny.yaml": [1, 2], "qwen2_5_vl_tiny_lora.yaml": [1, 2], "qwen2_5_vl_tiny_dpo.yaml": [1, 2],
           "qwen2_5_vl_tiny_colours.yaml": [1, 2], "qwen2_5_vl_tiny_grpo.yaml": [1, 2],
           "wan2_1_t2v_tiny.yaml": [1, 2], "wan2_1_t2v_tiny_dpo.yaml": [1, 2],
           "wan2_1_i2v_tiny.yaml": [1, 2], "wan2_2_ti2v_tiny.yaml": [1, 2], "wan2_2_a14b_tiny.yaml": [1, 2],
           "wan2_2_ti2v_5b.yaml": [8], "wan2_2_t2v_a14b.yaml": [16],
           "qwen2_5_vl_7b_sft.yaml": [8, 16], "qwen2_5_vl_7b_dpo.yaml": [8, 16],
           "qwen2_5_vl_7b_grpo.yaml": [8, 16], "wan2_1_t2v_1_3b_dpo.yaml": [8, 16],
           "qwen2_5_vl_72b_sft.yaml": [16, 32],
           "wan2_1_t2v_1_3b.yaml": [8, 16], "wan2_1_t2v_14b.yaml": [8, 16], "wan2_1_t2v_14b_zero3.yaml": [8, 16],
           "qwen3_vl_tiny.yaml": [1, 2], "qwen3_vl_moe_tiny.yaml": [1, 2], "qwen3_vl_8b_sft.yaml": [8, 16],
           "qwen3_vl_30b_a3b_sft.yaml": [16, 32], "qwen3_vl_30b_a3b_zero3.yaml": [16, 32],
           "qwen2_5_vl_32b_sft.yaml": [8, 16], "cogvideox_t2v_tiny.yaml": [1, 2],
           "cogvideox_i2v_tiny.yaml": [1, 2], "cogvideox1_5_t2v_tiny.yaml": [1, 2],
           "cogvideox1_5_i2v_tiny.yaml": [1, 2], "cogvideox_5b_t2v.yaml": [8, 16],
           "cogvideox1_5_5b_i2v.yaml": [8, 16], "cogvideox1_5_5b_t2v_lora.yaml": [8],
           "qwen2_5_omni_tiny.yaml": [1, 2], "qwen2_5_omni_7b_sft.yaml": [8, 16]}


@pytest.mark.parametrize("name, worlds", sorted(SHIPPED.items()))
def test_every_shipped_recipe_loads_and_fits_the_machines_it_is_written_for(name, worlds):
    from pathlib import Path

    import mm_train
    from mm_train.recipe import check_layout, load_recipe

    path = Path(mm_train.__file__).with_name("recipes") / name
    recipe = load_recipe(str(path))
    for world in worlds:
        assert check_layout(recipe, world) >= 1, (name, world)
    if recipe.model.path is None:  # the real ones' model folders are not here; the tiny ones' shapes fit
        from mm_train.preflight import check_before_launch

        check_before_launch(recipe)
    assert {p.name for p in path.parent.glob("*.yaml")} == set(SHIPPED)  # each shipped recipe is checked


def test_a_row_budget_that_cannot_hold_a_picture_is_refused_before_launch():
    from mm_train.preflight import check_before_launch

    with pytest.raises(ValueError, match=r"data.max_tokens=8 cannot hold a picture of data.max_pixels \(16 tokens\).*"
                                         r"set data.max_tokens >= 48"):
        check_before_launch(load_recipe(None, ["data.max_pixels=12544", "data.min_pixels=3136", "data.max_tokens=8"]))
    check_before_launch(load_recipe(None, ["data.max_tokens=8"]))  # 4-token pictures fit


def test_packed_rows_are_made_a_multiple_of_pp_for_the_interleaved_schedule():
    from mm_data.vl.packing import split_to_multiple

    rows = split_to_multiple([[0, 3, 4], [1], [2, 5]], 2)
    assert rows == [[0], [1], [2, 5], [3, 4]] and split_to_multiple(rows, 4) == rows
    with pytest.raises(ValueError, match="raise train.global_batch_size"):
        split_to_multiple([[0], [1], [2]], 2)


def test_a_ranks_rows_are_split_to_the_count_its_peers_run():
    """GRPO under ZeRO-3 / ep: every data-parallel rank runs as many micro-batches (mm_train.grpo_step)."""
    from mm_data.vl.packing import split_to_count

    assert split_to_count([[0, 1, 2, 3], [4]], 3) == [[0, 1], [2, 3], [4]]
    assert split_to_count([[0], [1]], 2) == [[0], [1]]
    with pytest.raises(ValueError, match="cannot fill the 3 micro-batches"):
        split_to_count([[0], [1]], 3)
