"""Qwen2.5-VL equals transformers' Qwen2_5_VLForConditionalGeneration (torch CPU, eager, float32)
on the same safetensors weights: logits and loss rel-err <= 1e-5, parameter gradients <= 1e-4,
greedy generation token for token, M-RoPE positions exactly."""

import numpy as np
import pytest
import torch  # noqa: F401  (the parity reference: required, see tests/conftest.py)
from helpers.qwen_vl_reference import IMAGE, VIDEO, assert_matches_reference, padded_pair, sample, write_reference

CASES = ["text", "image", "video", "image_video", "padded_pair"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from mm_models_vl import Qwen2_5_VLForConditionalGeneration

    path = tmp_path_factory.mktemp("qwen2_5_vl")
    reference = write_reference(path)
    return reference, Qwen2_5_VLForConditionalGeneration.from_pretrained(path)


@pytest.mark.parametrize("case", CASES)
def test_forward_and_gradients_match_transformers(models, case):
    reference, ours = models
    rng = np.random.default_rng(CASES.index(case))
    inputs = padded_pair(rng) if case == "padded_pair" else sample(case, rng)
    ref_grads = assert_matches_reference(reference, ours, inputs, grad_rel=1e-4)
    if case != "text":
        assert any(name.startswith("model.visual.") for name in ref_grads)


@pytest.mark.parametrize("case", ["text", "image", "image_video"])
def test_greedy_generation_matches_transformers(models, case):

    reference, ours = models
    inputs = sample(case, np.random.default_rng(10 + len(case)))
    inputs.pop("labels")
    expected = reference.generate(**{k: torch.from_numpy(v) for k, v in inputs.items()}, max_new_tokens=8,
                                  do_sample=False).numpy()
    tokens = ours.generate(**inputs, max_new_tokens=8)
    np.testing.assert_array_equal(tokens, expected)


def test_rope_index_matches_transformers(models):
    """Positions on random layouts: several images and videos per sample, padding, fractional seconds."""

    from mm_models_vl.qwen2_5_vl import positions

    reference, ours = models
    rng = np.random.default_rng(7)
    for _ in range(20):
        rows, images, videos, seconds = [], [], [], []
        for _ in range(2):
            ids = rng.integers(3, 240, rng.integers(1, 4)).tolist()
            for _ in range(rng.integers(0, 4)):
                grid = (int(rng.integers(1, 5)), 2 * int(rng.integers(1, 5)), 2 * int(rng.integers(1, 5)))
                is_video = rng.random() < 0.5
                if is_video:
                    videos.append(grid)
                    seconds.append(float(rng.choice([0.5, 1.0, 1.3, 2.0])))
                else:
                    grid = (1,) + grid[1:]
                    images.append(grid)
                ids += [VIDEO if is_video else IMAGE] * (grid[0] * grid[1] * grid[2] // 4)
                ids += rng.integers(3, 240, 2).tolist()
            rows.append(ids)
        length = max(map(len, rows)) + int(rng.integers(0, 3))
        ids, mask = np.zeros((2, length), np.int64), np.zeros((2, length), np.int64)
        for i, row in enumerate(rows):
            ids[i, :len(row)], mask[i, :len(row)] = row, 1
        types = positions.token_types(ids, IMAGE, VIDEO)
        grids = {"image_grid_thw": np.array(images, np.int64) if images else None,
                 "video_grid_thw": np.array(videos, np.int64) if videos else None,
                 "second_per_grid_ts": np.array(seconds, np.float32) if videos else None}
        if not images and not videos:
            continue
        torch_args = {k: torch.from_numpy(v) for k, v in grids.items() if v is not None}
        expected, expected_deltas = reference.model.get_rope_index(
            torch.from_numpy(ids), mm_token_type_ids=torch.from_numpy(types), attention_mask=torch.from_numpy(mask),
            **torch_args)
        got, deltas = positions.rope_index(ids, types, attention_mask=mask, spatial_merge_size=2,
                                           tokens_per_second=4, **grids)
        np.testing.assert_array_equal(got, expected.numpy())
        np.testing.assert_array_equal(deltas, expected_deltas.numpy())


def test_vision_layout_matches_transformers():
    """Window order, window and frame boundaries, rotary coordinates for odd grids."""
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_position_ids, get_vision_window_index

    from mm_models_vl.qwen2_5_vl import positions

    grids = np.array([[1, 8, 12], [3, 4, 6], [2, 10, 2], [1, 2, 18]], np.int64)
    order, bounds = positions.window_index(grids, 2, 56, 14)
    ref_order, ref_bounds = get_vision_window_index(torch.from_numpy(grids), 2, 56, 14)
    np.testing.assert_array_equal(order, ref_order.numpy())
    np.testing.assert_array_equal(bounds, ref_bounds.numpy())
    np.testing.assert_array_equal(positions.frame_cu_seqlens(grids),
                                  get_vision_cu_seqlens(torch.from_numpy(grids)).numpy())
    np.testing.assert_array_equal(positions.vision_rotary_positions(grids, 2),
                                  get_vision_position_ids(torch.from_numpy(grids), 2).numpy())


def test_bad_inputs_are_clear_errors(models):
    _, ours = models
    inputs = sample("image", np.random.default_rng(3))
    with pytest.raises(ValueError, match="no image pixels"):
        ours(input_ids=inputs["input_ids"])
    short = dict(inputs, pixel_values=inputs["pixel_values"][:-4])
    with pytest.raises(ValueError, match="patches"):
        ours(**short)
    wrong_grid = dict(inputs, image_grid_thw=np.array([[1, 4, 4]]), pixel_values=inputs["pixel_values"][:16])
    with pytest.raises(ValueError, match="not match"):
        ours(**wrong_grid)
