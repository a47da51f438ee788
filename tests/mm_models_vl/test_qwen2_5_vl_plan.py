"""The Qwen2.5-VL plan on one process: every recompute mode gives the gradients of none (padded
batch, vision blocks included) and runs the forwards it recomputes again in the backward,
freezing picks the right parameters, LoRA-wrapped models still save plain transformers
checkpoints, and layouts the model cannot take are refused with the rule."""

import numpy as np
import pytest
import torch  # noqa: F401  (the parity reference: required, see tests/conftest.py)
from helpers.forward_counts import counted_forwards
from helpers.qwen_vl_reference import our_forward, padded_pair, write_reference


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen_plan")
    write_reference(path)
    return path


def _load(path, **plan):
    from mm_models_vl import Qwen2_5_VLForConditionalGeneration
    from mm_models_vl.qwen2_5_vl.parallel_plan import parallelize

    return parallelize(Qwen2_5_VLForConditionalGeneration.from_pretrained(path), **plan)


def test_recompute_modes_equal_no_recompute(checkpoint):
    inputs = padded_pair(np.random.default_rng(0))
    loss, _, grads = our_forward(_load(checkpoint), inputs)
    for mode in ("full", "block", "selective"):
        again, _, regrads = our_forward(_load(checkpoint, recompute=mode, recompute_num_layers=1), inputs)
        assert again == loss, mode
        assert all(np.array_equal(regrads[k], grads[k]) for k in grads), mode


@pytest.mark.parametrize("mode, layers, cores, vision", [("full", [2, 2], [2, 2], 2), ("block", [2, 1], [2, 1], 1),
                                                         ("selective", [1, 1], [2, 2], 1)])
def test_recompute_modes_run_the_recomputed_forwards_again(checkpoint, mode, layers, cores, vision):
    from mm_models_vl import Qwen2_5_VLForConditionalGeneration
    from mm_models_vl.qwen2_5_vl.parallel_plan import parallelize
    from mm_parallel.recompute import CoreAttention

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint)
    decoder = list(model.model.language_model.layers)
    attention = [next(c for _, c in layer.cells_and_names() if isinstance(c, CoreAttention)) for layer in decoder]
    blocks = list(model.model.visual.blocks)
    with counted_forwards(decoder) as layer_calls, counted_forwards(attention) as core_calls, \
            counted_forwards(blocks) as block_calls:  # counted before the plan marks them
        parallelize(model, recompute=mode, recompute_num_layers=1)
        our_forward(model, padded_pair(np.random.default_rng(0)))
    assert list(layer_calls.values()) == layers and list(core_calls.values()) == cores
    assert set(block_calls.values()) == {vision}


def test_freeze_parts(checkpoint):
    model = _load(checkpoint, freeze=("vision", "language_model"))
    trainable = {name for name, p in model.parameters_and_names() if p.requires_grad}
    assert trainable and all(name.startswith("model.visual.merger.") for name in trainable)
    model = _load(checkpoint, freeze=("merger",))
    frozen = {name for name, p in model.parameters_and_names() if not p.requires_grad}
    assert frozen == {name for name, _ in model.parameters_and_names() if name.startswith("model.visual.merger.")}
    with pytest.raises(ValueError, match="cannot freeze"):
        _load(checkpoint, freeze=("vison",))


def test_lora_model_saves_base_checkpoint(checkpoint, tmp_path):
    from safetensors import safe_open

    from mm_models_vl.qwen2_5_vl.parallel_plan import LoraConfig

    model = _load(checkpoint, lora=LoraConfig(r=2, alpha=4.0))
    trainable = [name for name, p in model.parameters_and_names() if p.requires_grad]
    assert trainable and all(".lora_A" in n or ".lora_B" in n for n in trainable)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "np") as ours, \
            safe_open(str(checkpoint / "model.safetensors"), "np") as theirs:
        assert sorted(ours.keys()) == sorted(theirs.keys())
        for key in theirs.keys():
            assert np.array_equal(ours.get_tensor(key), theirs.get_tensor(key)), key


def test_layouts_the_model_cannot_take_are_refused():
    from helpers.qwen_vl_reference import tiny_config

    from mm_models_vl import Qwen2_5_VLForConditionalGeneration
    from mm_parallel import ParallelConfig
    from mm_parallel.topology import Topology

    with pytest.raises(ValueError, match=r"tp=4 must divide .* key/value heads \(2\)"):
        Qwen2_5_VLForConditionalGeneration(tiny_config(), Topology.build(ParallelConfig(tp=4), 4, 0))

    from mm_models_vl.qwen2_5_vl.parallel_plan import parallelize

    solo = Topology.build(ParallelConfig(), 1, 0)
    model = Qwen2_5_VLForConditionalGeneration(tiny_config(), solo)
    assert parallelize(model, solo) is model
    with pytest.raises(ValueError, match="build the model under the layout"):
        parallelize(model, Topology.build(ParallelConfig(), 1, 0))


@pytest.mark.parametrize("freeze, runs", [(("vision", "merger"), 1), (("vision",), 2)])
def test_a_frozen_tower_runs_once_per_micro_batch_in_a_pipeline_stage(checkpoint, freeze, runs):
    """A pipeline stage runs its forward again in its backward (mm_parallel.pipeline): a tower
    with no trainable parameter gives its first output again (kept in the micro-batch), one that
    trains (the merger) runs again. The stage's output is the same either way."""
    from mm_models_vl.qwen2_5_vl.modeling import TOWER_MEMO

    model = _load(checkpoint, freeze=freeze)
    batch = padded_pair(np.random.default_rng(0))
    with counted_forwards(list(model.model.visual.blocks)) as block_calls:
        first = model.pipeline_stage(None, batch).asnumpy()
        again = model.pipeline_stage(None, batch).asnumpy()
    assert set(block_calls.values()) == {runs} and np.array_equal(first, again)
    assert (TOWER_MEMO in batch and bool(batch[TOWER_MEMO])) == (runs == 1)
    assert model.model.tower_memo is None  # only while a stage embeds
