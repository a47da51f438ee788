"""Clip sampling throughput: mm_data's seek-and-decode-the-clip vs decoding every frame.

    python benchmarks/data_video.py [--videos 4] [--seconds 20] [--clips 24] [--runs 3]

Writes H.264 test videos (24 fps, 320 x 240, keyframe every 2 s) with PyAV, then draws random
clips (17 frames at 8 fps, as a Wan / CogVideoX data set would) two ways: `read_frames` (seek to
the keyframe before the clip, decode until its last frame) and the naive path (decode the whole
video, then index). The frames of both are asserted equal in this run; clips per second and the
ratio are printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np
from _timing import best_rate


def write_video(path, frames, height=240, width=320, fps=24):
    import av

    with av.open(path, "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt, stream.gop_size = width, height, "yuv420p", 2 * fps
        rng = np.random.default_rng(0)
        base = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        for i in range(frames):
            frame = np.roll(base, 4 * i, axis=1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def decode_everything(path):
    import av

    with av.open(path) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--videos", type=int, default=4)
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--clips", type=int, default=24)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    from mm_data.video import clip_indices, frame_step, probe, read_frames

    folder = tempfile.mkdtemp(prefix="mm-data-bench-")
    paths = [os.path.join(folder, f"v{i}.mp4") for i in range(args.videos)]
    for path in paths:
        write_video(path, 24 * args.seconds)
    infos = [probe(path) for path in paths]
    rng = np.random.default_rng(0)
    draws = []
    for _ in range(args.clips):
        k = int(rng.integers(len(paths)))
        draws.append((paths[k], clip_indices(infos[k].num_frames, 17, frame_step(infos[k].fps, 8.0), rng)))

    for path, indices in draws[:4]:
        assert np.array_equal(read_frames(path, indices), decode_everything(path)[indices])

    ours = best_rate(lambda: [read_frames(path, indices) for path, indices in draws], args.clips, args.runs)
    naive = best_rate(lambda: [decode_everything(path)[indices] for path, indices in draws], args.clips, args.runs)
    print(f"{args.clips} clips of 17 frames at 8 fps from {args.videos} H.264 videos of {args.seconds} s "
          f"(24 fps, 320 x 240), frames equal both ways")
    print(f"  decode every frame, then index  {naive:8.2f} clips/s")
    print(f"  mm_data read_frames (seek)      {ours:8.2f} clips/s   ratio {ours / naive:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
