"""Padding-free training (data.packing) against padded micro-batches at the same token budget.

    python benchmarks/packing.py [--samples 96] [--max-tokens 4096] [--runs 2]

A generated long-tailed set: lognormal lengths with a mean of about 563 tokens (MindSpeed-MM's
published average for its Qwen2.5-VL SFT data), at most 4,096, a third of the samples with a
112 x 112 image (16 merged tokens); labels on every text token. The tiny Qwen2.5-VL of the
built-in recipe (hidden 64, 2 layers, vision depth 2) takes a forward and backward of every
micro-batch of the set, cut two ways from the same sample order:
  padded   consecutive samples while (samples x the longest) <= the budget, padded to the longest
  packed   mm_data.vl.PackedRows: rows of whole samples of at most the budget (first-fit
           decreasing over the set), one row per micro-batch
Printed side by side: micro-batches, padding (the share of computed positions that are not real
tokens), real tokens per second (the best of ``--runs`` passes) and the ratio packed / padded.
Goal on this CPU: >= 2.0x with <= 5 % padding packed.

Also printed, what packing saves in work, counted from the shapes alone: the positions computed
(what the linear layers cost) and the attention scores computed (padded: b x Lmax^2 a
micro-batch; packed: the blocks mm_parallel's segment-blocked attention computes), each as the
cut's over the packed rows'. A speed-up beyond both comes only from fewer, larger calls.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

PATCH_DIM = 3 * 2 * 14 * 14
IMAGE, START, END = 250, 252, 253
GOALS = {"speed-up": 2.0, "padding": 0.05}


def generated_set(count: int, max_tokens: int, seed: int = 0):
    """Samples as mm-data's VL data set gives them (numpy keywords of one sample)."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(np.log(450), 0.67, count), max_tokens).astype(int).clip(24)
    samples = []
    for i, n in enumerate(lengths):
        image = i % 3 == 0
        ids = rng.integers(3, 240, n - (18 if image else 0)).tolist()
        if image:
            ids = ids[:2] + [START] + [IMAGE] * 16 + [END] + ids[2:]
        ids = np.array(ids, np.int64)
        labels = np.where(np.isin(ids, [IMAGE, START, END]), -100, ids)
        sample = {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": labels,
                  "mm_token_type_ids": (ids == IMAGE).astype(np.int64)}
        if image:
            sample["pixel_values"] = rng.standard_normal((64, PATCH_DIM)).astype(np.float32)
            sample["image_grid_thw"] = np.array([[1, 8, 8]], np.int64)
        samples.append(sample)
    return samples


def padded_batches(samples, collate, budget: int):
    """Consecutive samples while (count x the longest) fits the budget, padded to the longest."""
    batches, current = [], []
    for sample in samples:
        longest = max([len(s["input_ids"]) for s in current + [sample]])
        if current and longest * (len(current) + 1) > budget:
            batches.append(collate(current))
            current = []
        current.append(sample)
    return batches + ([collate(current)] if current else [])


def attention_scores(batches, packed: bool) -> int:
    """The (query, key) scores per head the micro-batches' attention computes (module docstring)."""
    from mm_parallel.ops.attention import segment_blocks

    if not packed:
        return sum(b["input_ids"].shape[0] * b["input_ids"].shape[1] ** 2 for b in batches)
    total = 0
    for batch in batches:
        blocks = segment_blocks(batch["attention_mask"])
        if blocks is None:  # the whole row under a mask
            total += batch["attention_mask"].size ** 2
        else:
            total += sum(gather.size * gather.shape[1] for gather, _ in blocks[0])
    return total


def tiny_model():
    from transformers import Qwen2_5_VLConfig

    from mm_models_vl import Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=256, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                           window_size=56, fullatt_block_indexes=[1], tokens_per_second=2),
        image_token_id=IMAGE, video_token_id=251, vision_start_token_id=START, vision_end_token_id=END)
    return Qwen2_5_VLForConditionalGeneration.from_config(config)


def pass_seconds(model, batches, runs: int) -> float:
    """The fastest of ``runs`` passes of forward + backward over every micro-batch."""
    import mindspore as ms

    params = model.trainable_params()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        for batch in batches:
            ms.value_and_grad(lambda b=batch: model(**b).loss, None, params)()
        best = min(best, time.perf_counter() - start)
    return best


def padding(batches) -> float:
    computed = sum(b["input_ids"].size for b in batches)
    return 1 - sum(int((b["attention_mask"] != 0).sum()) for b in batches) / computed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args(argv)
    import mindspore as ms

    from mm_data.loader import Collator
    from mm_data.vl import MEDIA_FIELDS, PackedRows

    ms.runtime.dispatch_threads_num(2)
    samples = generated_set(args.samples, args.max_tokens)
    real = sum(len(s["input_ids"]) for s in samples)
    collate = Collator(pad_values={"input_ids": 0}, concatenate=MEDIA_FIELDS)
    longest = max(len(s["input_ids"]) for s in samples)
    fixed = max(1, args.max_tokens // longest)  # the most samples a fixed-size micro-batch can hold
    ways = {"fixed": [collate(samples[i:i + fixed]) for i in range(0, len(samples), fixed)],
            "padded": padded_batches(samples, collate, args.max_tokens),
            "packed": PackedRows(collate, args.max_tokens)(samples)}
    model = tiny_model()
    pass_seconds(model, ways["packed"][:1], 1)  # warm-up
    print(f"{args.samples} samples, {real} real tokens (mean {real / args.samples:.0f}), "
          f"{sum('pixel_values' in s for s in samples)} with an image; budget {args.max_tokens} tokens")
    print(f"{'':8} {'micro-batches':>13} {'padding':>8} {'real tokens/s':>14}")
    rates = {}
    for name, batches in ways.items():
        rates[name] = real / pass_seconds(model, batches, args.runs)
        print(f"{name:8} {len(batches):13d} {padding(batches):8.1%} {rates[name]:14.0f}")
    for base in ("fixed", "padded"):
        positions = sum(b["input_ids"].size for b in ways[base]) / sum(b["input_ids"].size for b in ways["packed"])
        scores = attention_scores(ways[base], False) / attention_scores(ways["packed"], True)
        print(f"packed / {base}: {rates['packed'] / rates[base]:.2f}x real tokens per second "
              f"(goal >= {GOALS['speed-up']}x; work saved: {positions:.2f}x positions, {scores:.2f}x "
              "attention scores)")
    print(f"packed padding {padding(ways['packed']):.1%} (goal <= {GOALS['padding']:.0%})")


if __name__ == "__main__":
    main()
