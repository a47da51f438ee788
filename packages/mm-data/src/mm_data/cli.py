"""`mm-data`: convert a data set into shards, inspect one.

    mm-data convert ANNOTATIONS OUT --format parquet|webdataset [--media embed|reference]
                    [--rows-per-shard N] [--rows-per-block N] [--media-dir DIR] [--kind auto|vl|video]
    mm-data inspect PATH [--kind vl|video] [--tokenizer TOKENIZER] [--format json|parquet|webdataset|arrow]
                    [--max-length N] [--max-tokens N] [--micro-batch-size N] [--min-pixels N]
                    [--max-pixels N] [--video-fps F] [--png OUT.png]
                    video: [--num-frames N] [--fps F] [--max-area N] [--global-batch-size N]

Both print one JSON report on stdout (inspect's histograms go to the PNG).
"""

from __future__ import annotations

import argparse
import json
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mm-data", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser("convert", help="LLaMA-Factory JSON / JSONL + media -> shards")
    convert.add_argument("annotations")
    convert.add_argument("out")
    convert.add_argument("--format", choices=["parquet", "webdataset"], default="parquet")
    convert.add_argument("--media", choices=["embed", "reference"], default="embed")
    convert.add_argument("--rows-per-shard", type=int, default=1000)
    convert.add_argument("--rows-per-block", type=int, default=64)
    convert.add_argument("--media-dir", default=None)
    convert.add_argument("--kind", choices=["auto", "vl", "video"], default="auto",
                         help="vl: LLaMA-Factory conversations; video: captioned clips (auto: told from the file)")
    inspect = commands.add_parser("inspect", help="sample counts, bad media, token / frame histograms, padding")
    inspect.add_argument("path")
    inspect.add_argument("--kind", choices=["vl", "video"], default="vl")
    inspect.add_argument("--tokenizer", default=None, help="vl: a model folder or a tokenizer.json")
    inspect.add_argument("--num-frames", type=int, default=81, help="video: clip length (1 + 4n)")
    inspect.add_argument("--fps", type=float, default=16.0, help="video: frames per second sampled")
    inspect.add_argument("--max-area", type=int, default=480 * 832, help="video: the buckets' pixels")
    inspect.add_argument("--global-batch-size", type=int, default=1, help="video: samples a step")
    inspect.add_argument("--format", choices=["json", "parquet", "webdataset", "arrow"], default="json")
    inspect.add_argument("--max-length", type=int, default=4096)
    inspect.add_argument("--max-tokens", type=int, default=None, help="packed rows' budget (default: max-length)")
    inspect.add_argument("--micro-batch-size", type=int, default=1)
    inspect.add_argument("--media-dir", default=None)
    inspect.add_argument("--min-pixels", type=int, default=None, help="image / frame pixel bounds (the processors')")
    inspect.add_argument("--max-pixels", type=int, default=None)
    inspect.add_argument("--video-fps", type=float, default=2.0)
    inspect.add_argument("--png", default=None, help="write the histograms here")
    return parser


def _tokenizer(path: str):
    import os

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if path.endswith(".json") and os.path.isfile(path):
        return PreTrainedTokenizerFast(tokenizer_file=path)
    return AutoTokenizer.from_pretrained(path)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "convert":
        from mm_data.shards.convert import convert

        report = convert(args.annotations, args.out, args.format, args.media, args.rows_per_shard,
                         args.rows_per_block, args.media_dir, args.kind)
    elif args.kind == "video":
        from mm_data.inspection import inspect_video
        from mm_data.video import AspectBuckets, FrameBuckets, VideoTextDataset

        dataset = VideoTextDataset.from_annotations(args.path, max_bad_fraction=1.0, data_format=args.format,
                                                    frames=FrameBuckets(num_frames=args.num_frames), fps=args.fps,
                                                    buckets=AspectBuckets(max_area=args.max_area, stride=16))
        report = inspect_video(dataset, args.global_batch_size)
    else:
        if not args.tokenizer:
            raise SystemExit("mm-data inspect --kind vl needs --tokenizer (a model folder or a tokenizer.json)")
        from mm_data.inspection import inspect_vl
        from mm_data.vl import Qwen2VLImageProcessor, Qwen2VLVideoProcessor, VLSFTDataset

        bounds = {k: v for k, v in (("min_pixels", args.min_pixels), ("max_pixels", args.max_pixels)) if v}
        dataset = VLSFTDataset.from_file(args.path, _tokenizer(args.tokenizer), media_dir=args.media_dir,
                                         max_length=args.max_length, max_bad_fraction=1.0, data_format=args.format,
                                         image_processor=Qwen2VLImageProcessor(**bounds),
                                         video_processor=Qwen2VLVideoProcessor(**bounds), video_fps=args.video_fps)
        report = inspect_vl(dataset, args.max_tokens or args.max_length, args.micro_batch_size)
        report["bad"] = [list(item) for item in dataset.bad_input.skipped] + report["bad"]  # read, then asked
    if args.command == "inspect":
        if args.png:
            from mm_data.inspection import write_histograms

            report["png"] = write_histograms(report, args.png)
        report.pop("_values")
    json.dump(report, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
