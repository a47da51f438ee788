"""What a data set holds before anyone trains on it (`mm-data inspect`).

For a video set (`inspect_video`): clips, bad ones, frames / seconds / sizes, the buckets and what
an epoch of global batches leaves out of each. For a LLaMA-Factory file or a set of shards
(`inspect_vl`): the number of samples and of bad ones (missing or unreadable media, placeholders
that do not match, each named), each usable sample's tokens (from image headers and video probes,
or the shards' media_info: no pixels decoded), its media tokens and its videos' frames and
seconds; the padding the batch settings would cost — packed rows of ``max_tokens`` (the order
given, `mm_data.vl.plan_rows`) or micro-batches of ``micro_batch_size`` padded to their longest;
and histograms of tokens, frames and seconds written as a PNG.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np

from mm_data.errors import BadSample


def inspect_vl(dataset, max_tokens: Optional[int] = None, micro_batch_size: int = 1) -> Dict:
    """The report of a `VLSFTDataset` (see the module docstring)."""
    from mm_data.vl.packing import plan_rows

    tokens: List[int] = []
    media_tokens: List[int] = []
    frames: List[int] = []
    seconds: List[float] = []
    bad: List[List[str]] = []
    for index in range(len(dataset)):
        try:
            conversation = dataset.conversations[index]
            length, vision = dataset.costs(index)  # (tokens, vision tokens), from headers or media_info
            for number in range(len(conversation.videos)):
                info = dataset.video_info(conversation, number)
                frames.append(info.num_frames)
                seconds.append(info.duration)
        except BadSample as error:
            bad.append([error.source, error.reason])
            continue
        tokens.append(length)
        media_tokens.append(int(vision))
    report = {"samples": len(dataset), "bad": bad, "tokens": _summary(tokens), "media_tokens": _summary(media_tokens),
              "video_frames": _summary(frames), "video_seconds": _summary(seconds)}
    if tokens and max_tokens:
        rows, oversized = plan_rows(tokens, max_tokens)
        used = sum(tokens)
        report["packing"] = {"max_tokens": max_tokens, "rows": len(rows), "oversized": len(oversized),
                             "padding": round(1 - used / (len(rows) * max_tokens), 4)}
    if tokens:
        batches = [tokens[i:i + micro_batch_size] for i in range(0, len(tokens), micro_batch_size)]
        padded = sum(max(batch) * len(batch) for batch in batches)
        report["padded_batches"] = {"micro_batch_size": micro_batch_size, "padding": round(1 - sum(tokens) / padded, 4)}
    report["_values"] = {"tokens": tokens, "video frames": frames, "video seconds": seconds}
    return report


def inspect_video(dataset, global_batch_size: int = 1) -> Dict:
    """The report of a `VideoTextDataset`: clips, bad ones (read when the set was built), frames,
    seconds and sizes, the samples of each bucket (frames, height, width) and how many of them an
    epoch of global batches of ``global_batch_size`` (one bucket each) leaves out."""
    infos = dataset.infos
    buckets: Dict[str, int] = {}
    for key in dataset.keys:
        buckets[" x ".join(map(str, key))] = buckets.get(" x ".join(map(str, key)), 0) + 1
    left = sum(count % global_batch_size for count in buckets.values())
    bad = [list(b) for b in dataset.bad_input.skipped]
    return {"samples": len(dataset) + len(bad), "bad": bad,
            "video_frames": _summary([i.num_frames for i in infos]),
            "video_seconds": _summary([i.duration for i in infos]),
            "pixels": _summary([i.height * i.width for i in infos]), "buckets": buckets,
            "batches": {"global_batch_size": global_batch_size, "left_out_per_epoch": left,
                        "share": round(left / max(len(dataset), 1), 4)},
            "_values": {"video frames": [i.num_frames for i in infos], "video seconds": [i.duration for i in infos]}}


def _summary(values) -> Dict:
    if not values:
        return {"count": 0}
    array = np.asarray(values, np.float64)
    return {"count": int(array.size), "min": float(array.min()), "mean": round(float(array.mean()), 3),
            "p50": float(np.percentile(array, 50)), "p95": float(np.percentile(array, 95)), "max": float(array.max())}


def write_histograms(report: Dict, path: str) -> str:
    """The report's tokens, frames and seconds as one PNG of histograms (drawn with PIL: no plotting
    library needed)."""
    values = {name: v for name, v in report["_values"].items() if v}
    from PIL import Image, ImageDraw

    width, height, pad = 420, 220, 24
    canvas = Image.new("RGB", (width, height * max(len(values), 1)), "white")
    draw = ImageDraw.Draw(canvas)
    for row, (name, data) in enumerate(values.items()):
        counts, edges = np.histogram(np.asarray(data, np.float64), bins=20)
        top = row * height
        draw.text((pad, top + 4), f"{name}: {len(data)} values, {edges[0]:g} .. {edges[-1]:g}", fill="black")
        bar = (width - 2 * pad) / len(counts)
        for i, count in enumerate(counts):
            h = (height - 3 * pad) * count / max(counts.max(), 1)
            x = pad + i * bar
            draw.rectangle([x, top + height - pad - h, x + bar - 2, top + height - pad], fill=(70, 110, 180))
    canvas.save(path)
    return path
