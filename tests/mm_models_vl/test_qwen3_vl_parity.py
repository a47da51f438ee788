"""Qwen3-VL and Qwen3-VL-MoE equal transformers' classes (torch CPU, eager, float32) on the same
safetensors weights: loss, logits and every parameter's gradient rel-err <= 1e-5 (the MoE loss
includes router_aux_loss_coef x the load-balancing loss, and aux_loss itself is compared), greedy
generation token for token, positions and the learned-position interpolation exactly; what
save_pretrained writes loads in transformers with the same tensors, experts in the layout read."""

import numpy as np
import pytest
from helpers.qwen3_vl_reference import IMAGE, VIDEO, padded_pair, sample, video_placeholders, write_reference
from helpers.qwen_vl_reference import assert_matches_reference

CASES = ["text", "image", "video", "image_video", "padded_pair"]
MOE_CASES = ["text", "image_video", "padded_pair"]


def _ours(moe: bool):
    from mm_models_vl import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

    return Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for moe in (False, True):
        path = tmp_path_factory.mktemp("qwen3_vl_moe" if moe else "qwen3_vl")
        reference = write_reference(path, moe=moe)
        out[moe] = (reference, _ours(moe).from_pretrained(path), path)
    return out


def _inputs(case, seed):
    rng = np.random.default_rng(seed)
    return padded_pair(rng) if case == "padded_pair" else sample(case, rng)


@pytest.mark.parametrize("case", CASES)
def test_dense_forward_and_gradients_match_transformers(models, case):
    reference, ours, _ = models[False]
    ref_grads = assert_matches_reference(reference, ours, _inputs(case, CASES.index(case)), grad_rel=1e-5)
    if case != "text":
        assert any(".deepstack_merger_list." in name for name in ref_grads)  # DeepStack is trained


@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_forward_gradients_and_aux_loss_match_transformers(models, case):
    import torch

    reference, ours, _ = models[True]
    inputs = _inputs(case, 20 + MOE_CASES.index(case))
    ref_grads = assert_matches_reference(reference, ours, inputs, grad_rel=1e-5)
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in ref_grads)
    with torch.no_grad():
        expected = reference(**{k: torch.from_numpy(v) for k, v in inputs.items()}).aux_loss.item()
    aux = float(ours(**inputs).aux_loss.asnumpy())
    assert abs(aux - expected) <= 1e-5 * abs(expected)
    without = ours(**inputs, output_router_logits=False)
    assert without.aux_loss is None


@pytest.mark.parametrize("moe,case", [(False, "text"), (False, "image"), (False, "video"), (True, "image_video")])
def test_greedy_generation_matches_transformers(models, moe, case):
    import torch

    reference, ours, _ = models[moe]
    inputs = _inputs(case, 10 + len(case))
    inputs.pop("labels")
    expected = reference.generate(**{k: torch.from_numpy(v) for k, v in inputs.items()}, max_new_tokens=8,
                                  do_sample=False).numpy()
    np.testing.assert_array_equal(ours.generate(**inputs, max_new_tokens=8), expected)


def test_rope_index_matches_transformers(models):
    """Positions on random layouts: several images and per-frame video groups per sample, padding."""
    import torch

    from mm_models_vl.qwen3_vl import positions

    reference, _, _ = models[False]
    rng = np.random.default_rng(7)
    for _ in range(20):
        rows, images, videos = [], [], []
        for _ in range(2):
            ids = rng.integers(3, 240, rng.integers(1, 4)).tolist()
            for _ in range(rng.integers(1, 4)):
                grid = (int(rng.integers(1, 4)), 2 * int(rng.integers(1, 5)), 2 * int(rng.integers(1, 5)))
                if rng.random() < 0.5:
                    videos.append(grid)
                    ids += video_placeholders(grid, rng)
                else:
                    images.append((1,) + grid[1:])
                    ids += [IMAGE] * (grid[1] * grid[2] // 4) + rng.integers(3, 240, 2).tolist()
            rows.append(ids)
        length = max(map(len, rows)) + int(rng.integers(0, 3))
        ids, mask = np.zeros((2, length), np.int64), np.zeros((2, length), np.int64)
        for i, row in enumerate(rows):
            ids[i, :len(row)], mask[i, :len(row)] = row, 1
        types = positions.token_types(ids, IMAGE, VIDEO)
        grids = {"image_grid_thw": np.array(images, np.int64) if images else None,
                 "video_grid_thw": np.array(videos, np.int64) if videos else None}
        expected, expected_deltas = reference.model.get_rope_index(
            torch.from_numpy(ids), mm_token_type_ids=torch.from_numpy(types), attention_mask=torch.from_numpy(mask),
            **{k: torch.from_numpy(v) for k, v in grids.items() if v is not None})
        got, deltas = positions.rope_index(ids, types, attention_mask=mask, spatial_merge_size=2, **grids)
        np.testing.assert_array_equal(got, expected.numpy())
        np.testing.assert_array_equal(deltas, expected_deltas.numpy())


def test_position_interpolation_matches_transformers():
    """The learned-table taps and weights for grids smaller, larger and not square against the table."""
    import torch
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    from mm_models_vl.qwen3_vl import positions

    grids = np.array([[1, 8, 12], [3, 4, 6], [2, 10, 2], [1, 2, 18], [1, 48, 48]], np.int64)
    for table in (16, 2304):
        index, weights = positions.position_embedding_taps(grids, table, 2)
        ref_index, ref_weights = get_vision_interpolation_indices_and_weights(
            torch.from_numpy(grids), num_grid_per_side=int(table ** 0.5), mode="bilinear", align_corners=True,
            spatial_merge_size=2)
        np.testing.assert_array_equal(index, ref_index.numpy())
        np.testing.assert_array_equal(weights, ref_weights.numpy())


@pytest.mark.parametrize("moe,layout", [(False, None), (True, "fused_transposed"), (True, "per_expert")])
def test_saved_folder_loads_in_transformers(models, tmp_path, moe, layout):
    """save_pretrained writes every tensor as loaded; transformers reads the folder back to the same
    weights. The MoE model read from the hub's transposed experts writes them back so; read from
    one tensor per expert (which transformers cannot read) it writes the hub's layout."""
    import transformers
    from safetensors.numpy import load_file

    from mm_parallel.moe.checkpoint import convert_folder

    reference, _, path = models[moe]
    source = expected = path
    if layout:
        source, expected = tmp_path / "source", tmp_path / "expected"
        convert_folder(str(path), str(source), layout)
        convert_folder(str(path), str(expected), "fused_transposed")
    ours = _ours(moe).from_pretrained(source)
    ours.save_pretrained(tmp_path / "saved")
    written, original = load_file(str(tmp_path / "saved" / "model.safetensors")), {}
    for name in sorted(expected.glob("*.safetensors")):
        original.update(load_file(str(name)))
    assert sorted(written) == sorted(original)
    assert all(np.array_equal(written[k], original[k]) for k in original)
    cls = transformers.Qwen3VLMoeForConditionalGeneration if moe else transformers.Qwen3VLForConditionalGeneration
    loaded = cls.from_pretrained(str(tmp_path / "saved"))
    weights = reference.state_dict()
    assert sorted(loaded.state_dict()) == sorted(weights)
    assert all(np.array_equal(v.numpy(), weights[k].numpy()) for k, v in loaded.state_dict().items())


def test_bad_inputs_are_clear_errors(models):
    _, ours, _ = models[False]
    inputs = sample("image", np.random.default_rng(3))
    with pytest.raises(ValueError, match="mm_token_type_ids"):
        ours(**{k: v for k, v in inputs.items() if k != "mm_token_type_ids"})
    with pytest.raises(ValueError, match="no image pixels"):
        ours(input_ids=inputs["input_ids"])
    with pytest.raises(ValueError, match="patches"):
        ours(**dict(inputs, pixel_values=inputs["pixel_values"][:-4]))
