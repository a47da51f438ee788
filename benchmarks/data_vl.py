"""Images per second through mm_data's Qwen2VLImageProcessor vs transformers' PIL processor.

    python benchmarks/data_vl.py [--images 64] [--runs 3]

The same random RGB images (sizes 200-900 px a side) go through both; the outputs are asserted
bit-identical in the same run, then each side's best-of-``--runs`` throughput and the ratio are
printed (goal >= 3x). Videos arrive with the video processor (issue 7).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    from mm_data.vl import Qwen2VLImageProcessor

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (int(rng.integers(200, 900)), int(rng.integers(200, 900)), 3),
                                           dtype=np.uint8)) for _ in range(args.images)]
    ours, theirs = Qwen2VLImageProcessor(), Qwen2VLImageProcessorPil()
    got, want = ours(images), theirs(images, return_tensors="np")
    assert np.array_equal(got["pixel_values"], want["pixel_values"])
    assert np.array_equal(got["image_grid_thw"], want["image_grid_thw"])

    def best(fn):
        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return args.images / min(times)

    ours_rate = best(lambda: ours(images))
    theirs_rate = best(lambda: theirs(images, return_tensors="np"))
    print(f"Qwen2-VL image preprocessing, {args.images} images of 200-900 px, outputs bit-identical")
    print(f"ours          {ours_rate:8.1f} images/s")
    print(f"transformers  {theirs_rate:8.1f} images/s")
    print(f"ratio ours / transformers: {ours_rate / theirs_rate:.2f}  (goal >= 3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
