"""Images and video frames per second through mm_data's Qwen2-VL processors vs transformers' PIL processor.

    python benchmarks/data_vl.py [--images 64] [--videos 4] [--frames 32] [--runs 3]

Images: the same random RGB images (200-900 px a side) go through ours and transformers'
Qwen2VLImageProcessorPil; outputs are asserted bit-identical in this run. Ours is timed on one
thread (as transformers runs) and with ``num_threads=2``.

Videos: transformers' Qwen2VLVideoProcessor needs torchvision, which cannot be installed beside the
CPU torch here, so the reference for video frames is transformers' PIL image processor applied to
each frame (the arithmetic our video processor uses); each temporal slot of our patches is asserted
equal to the reference's patches of that frame in this run. Best of ``--runs``; ratios printed.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from _timing import best_rate


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--videos", type=int, default=4)
    parser.add_argument("--frames", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    from mm_data.vl import Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (int(rng.integers(200, 900)), int(rng.integers(200, 900)), 3),
                                           dtype=np.uint8)) for _ in range(args.images)]
    ours, threaded, theirs = Qwen2VLImageProcessor(), Qwen2VLImageProcessor(num_threads=2), Qwen2VLImageProcessorPil()
    want = theirs(images, return_tensors="np")
    for processor in (ours, threaded):
        got = processor(images)
        assert np.array_equal(got["pixel_values"], want["pixel_values"])
        assert np.array_equal(got["image_grid_thw"], want["image_grid_thw"])
    theirs_rate = best_rate(lambda: theirs(images, return_tensors="np"), args.images, args.runs)
    ours_rate = best_rate(lambda: ours(images), args.images, args.runs)
    threaded_rate = best_rate(lambda: threaded(images), args.images, args.runs)
    print(f"Qwen2-VL image preprocessing, {args.images} images of 200-900 px, outputs bit-identical")
    print(f"  transformers (PIL)    {theirs_rate:8.1f} images/s")
    print(f"  ours, 1 thread        {ours_rate:8.1f} images/s   ratio {ours_rate / theirs_rate:.2f}")
    ratio = threaded_rate / theirs_rate
    print(f"  ours, 2 threads       {threaded_rate:8.1f} images/s   ratio {ratio:.2f}  (goal >= 3)")

    options = {"min_pixels": 128 * 28 * 28, "max_pixels": 768 * 28 * 28}
    videos = [rng.integers(0, 256, (args.frames, int(rng.integers(240, 480)), int(rng.integers(320, 640)), 3),
                           dtype=np.uint8) for _ in range(args.videos)]
    ours_v, threaded_v = Qwen2VLVideoProcessor(**options), Qwen2VLVideoProcessor(**options, num_threads=2)
    frames = Qwen2VLImageProcessorPil(**options)
    per_frame = lambda: [frames([Image.fromarray(f) for f in video], return_tensors="np") for video in videos]  # noqa: E731
    reference = per_frame()
    for processor in (ours_v, threaded_v):
        got = processor(videos=videos)
        start = 0
        for number, (video, ref) in enumerate(zip(videos, reference)):
            grid_t, grid_h, grid_w = got["video_grid_thw"][number]
            rows = grid_t * grid_h * grid_w
            patches = got["pixel_values_videos"][start:start + rows].reshape(grid_t, grid_h * grid_w, 3, 2, 196)
            frame_patches = ref["pixel_values"].reshape(len(video), grid_h * grid_w, 3, 2, 196)[:, :, :, 0]
            for t in range(len(video)):
                assert np.array_equal(patches[t // 2, :, :, t % 2], frame_patches[t])
            start += rows
    count = args.videos * args.frames
    theirs_rate = best_rate(per_frame, count, args.runs)
    ours_rate = best_rate(lambda: ours_v(videos=videos), count, args.runs)
    threaded_rate = best_rate(lambda: threaded_v(videos=videos), count, args.runs)
    print(f"Qwen2-VL video preprocessing, {args.videos} clips x {args.frames} frames of 240-480 x 320-640 px, "
          f"frames bit-identical to the per-frame reference")
    print(f"  transformers PIL, per frame  {theirs_rate:8.1f} frames/s")
    print(f"  ours, 1 thread               {ours_rate:8.1f} frames/s   ratio {ours_rate / theirs_rate:.2f}")
    print(f"  ours, 2 threads              {threaded_rate:8.1f} frames/s   ratio {threaded_rate / theirs_rate:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
