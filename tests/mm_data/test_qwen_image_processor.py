"""mm_data's Qwen2VLImageProcessor gives arrays bit-identical to transformers' PIL processor."""

import numpy as np
import pytest


def _reference(**kwargs):
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**kwargs)


@pytest.mark.parametrize("kwargs", [{}, {"min_pixels": 64 * 28 * 28, "max_pixels": 256 * 28 * 28},
                                    {"do_normalize": False}])
def test_bit_identical_to_transformers_on_many_sizes(kwargs):
    from PIL import Image

    from mm_data.vl import Qwen2VLImageProcessor

    rng = np.random.default_rng(0)
    ours, theirs = Qwen2VLImageProcessor(**kwargs), _reference(**kwargs)
    sizes = [(rng.integers(8, 700), rng.integers(8, 700)) for _ in range(12)] + [(1000, 28), (28, 1000), (13, 17)]
    for h, w in sizes:
        modes = ["RGB", "L", "RGBA"]
        image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        pil = Image.fromarray(image).convert(modes[(h + w) % 3])
        got, want = ours([pil]), theirs([pil], return_tensors="np")
        np.testing.assert_array_equal(got["image_grid_thw"], want["image_grid_thw"])
        assert got["pixel_values"].dtype == want["pixel_values"].dtype == np.float32
        assert np.array_equal(got["pixel_values"], want["pixel_values"]), (h, w, pil.mode)


def test_batch_of_images_and_numpy_input():
    from PIL import Image

    from mm_data.vl import Qwen2VLImageProcessor

    rng = np.random.default_rng(1)
    arrays = [rng.integers(0, 256, (rng.integers(30, 300), rng.integers(30, 300), 3), dtype=np.uint8) for _ in range(3)]
    got = Qwen2VLImageProcessor()(arrays)
    want = _reference()([Image.fromarray(a) for a in arrays], return_tensors="np")
    np.testing.assert_array_equal(got["image_grid_thw"], want["image_grid_thw"])
    assert np.array_equal(got["pixel_values"], want["pixel_values"])
    threaded = Qwen2VLImageProcessor(num_threads=2)(arrays)  # threads change nothing but the speed
    assert np.array_equal(threaded["pixel_values"], got["pixel_values"])
    with pytest.raises(ValueError, match="aspect ratio"):
        Qwen2VLImageProcessor()([np.zeros((2, 500, 3), np.uint8)])
