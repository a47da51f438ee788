"""Rollout decoding (mm_parallel.decoding) against the decoders it replaces, side by side.

    python benchmarks/generate.py [--tokens 64] [--copies 8] [--prompt 512] [--pp-tokens 24]

1. Batched sampling: G = ``--copies`` sampled completions of ``--tokens`` tokens of one prompt (a
   picture and text), the prompt run once and its cache repeated, against the one-prompt-at-a-
   time cached decoding `generate` did before (a prefill and ``--tokens`` steps per completion,
   G times). Tokens per second of each and the ratio (goal >= 4x).
2. Under pp2 (two processes): the cached decoder, each stage keeping its layers' cache, against
   `greedy_by_reforward` (the samples' decoder under pp / cp / sp until now, kept here as the
   baseline): a whole forward pass over the sequence so far per token. ``--pp-tokens`` greedy
   tokens after prompts of each ``--prompt`` length; tokens per second and the ratio (goal >= 5x).
   The ratio grows with the prompt: a re-forward costs the whole sequence, a cached step one
   token, whose cost here is MindSpore's per-operator launch on CPU (~0.25 ms x ~55 operators per
   layer, profiled) plus the stage transfer and the tokens' broadcast.

The model is a random Qwen2.5-VL at a small width (hidden 256, 4 layers, vocabulary 4096) in
float32; the best of ``--runs`` rounds, the two sides alternating so that both see the machine's
load (ratios, not absolute times: the machine is shared).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

IMAGE, START, END = 4000, 4001, 4002
GRID = (1, 8, 8)  # 16 merged tokens


def config():
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config=dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         intermediate_size=768, vocab_size=4096, eos_token_id=2, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 6, 6]}),
        vision_config=dict(depth=2, hidden_size=64, num_heads=4, intermediate_size=128, out_hidden_size=256,
                           window_size=56, fullatt_block_indexes=[1]),
        image_token_id=IMAGE, video_token_id=4003, vision_start_token_id=START, vision_end_token_id=END)


def prompt(length: int, seed: int = 0) -> dict:
    """One prompt of ``length`` tokens: text, a picture, text."""
    rng = np.random.default_rng(seed)
    picture = [START] + [IMAGE] * (int(np.prod(GRID)) // 4) + [END]
    head = rng.integers(3, 3900, 4).tolist()
    ids = head + picture + rng.integers(3, 3900, length - len(head) - len(picture)).tolist()
    return {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, length), np.int64),
            "pixel_values": rng.standard_normal((int(np.prod(GRID)), 3 * 2 * 14 * 14)).astype(np.float32),
            "image_grid_thw": np.array([GRID], np.int64)}


def model(topo=None):
    import mindspore as ms

    from mm_models_vl import Qwen2_5_VLForConditionalGeneration

    ms.set_seed(0)
    chunk = Qwen2_5_VLForConditionalGeneration.from_config(config(), topo)
    chunk.set_train(False)
    return chunk


def batched_against_one_at_a_time(tokens: int, copies: int, length: int, runs: int):
    from mm_parallel.decoding import decode
    from mm_parallel.sampling import Sampling

    chunk, inputs = model(), prompt(length)
    sampling = Sampling(do_sample=True, temperature=1.0, top_p=0.95)

    def batched():
        out = decode([chunk], inputs, tokens, sampling, copies=copies, seed=1)
        assert out.tokens.shape == (copies, tokens)

    def one_at_a_time():
        for copy in range(copies):
            out = decode([chunk], inputs, tokens, sampling, seed=1, keys=[(0, copy)])
            assert out.tokens.shape == (1, tokens)

    times = {"batched": [], "one": []}
    for _ in range(runs):
        for name, fn in (("batched", batched), ("one", one_at_a_time)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    made = copies * tokens
    return made / min(times["batched"]), made / min(times["one"])


def greedy_by_reforward(chunks, topo, inputs, max_new_tokens: int):
    """The decoder the samples used under pp / cp / sp before mm_parallel.decoding: each token from
    a whole forward pass over the sequence so far (forward_only through the stages), the last
    stage's choice broadcast."""
    import mindspore as ms

    from mm_parallel import comm, pipeline

    ids, new = inputs["input_ids"], []
    media = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    for _ in range(max_new_tokens):
        batch = {**media, "input_ids": ids, "attention_mask": np.ones_like(ids)}
        picked = pipeline.forward_only([c.pipeline_stage for c in chunks], [(batch, batch)],
                                       lambda y, b: int(y[0, -1].asnumpy().argmax()), topo, with_batch=True)
        token = ms.Tensor(np.array([picked[0] if picked else 0], np.int32))
        token = int(comm.broadcast(token, topo.pp.ranks[-1], topo.pp).asnumpy()[0])
        new.append(token)
        ids = np.concatenate([ids, [[token]]], 1)
    return np.asarray(new)


def pipeline_cached_against_reforward(tokens: int, length: int, runs: int):
    """Runs on each of two ranks (pp2): {"cached": seconds, "reforward": seconds, "same": bool}."""
    import mm_parallel
    from mm_parallel import ParallelConfig
    from mm_parallel.decoding import decode

    topo = mm_parallel.initialize(ParallelConfig(pp=2))
    chunks, inputs = [model(topo)], prompt(length)
    times, outs = {"cached": [], "reforward": []}, {}
    for _ in range(runs):
        mm_parallel.comm.barrier(topo.world)
        start = time.perf_counter()
        outs["cached"] = decode(chunks, inputs, tokens, topology=topo).tokens[0]
        times["cached"].append(time.perf_counter() - start)
        mm_parallel.comm.barrier(topo.world)
        start = time.perf_counter()
        outs["reforward"] = greedy_by_reforward(chunks, topo, inputs, tokens)
        times["reforward"].append(time.perf_counter() - start)
    return {"cached": min(times["cached"]), "reforward": min(times["reforward"]),
            "same": bool(np.array_equal(outs["cached"], outs["reforward"]))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--sample-prompt", type=int, default=128, help="prompt length of the sampling comparison")
    parser.add_argument("--prompt", type=int, nargs="+", default=[256, 1024],
                        help="prompt lengths of the pp2 comparison")
    parser.add_argument("--pp-tokens", type=int, default=24)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    batched, one = batched_against_one_at_a_time(args.tokens, args.copies, args.sample_prompt, args.runs)
    print(f"{args.copies} sampled completions x {args.tokens} tokens, a {args.sample_prompt}-token prompt:")
    print(f"  batched (prompt once, cache repeated) {batched:8.1f} tokens/s")
    print(f"  one prompt at a time                  {one:8.1f} tokens/s")
    print(f"  ratio {batched / one:.1f}x (goal >= 4x)")

    from mm_parallel.launch import run_distributed

    for length in args.prompt:
        ranks = run_distributed(pipeline_cached_against_reforward, nproc=2, timeout=1800, tokens=args.pp_tokens,
                                length=length, runs=args.runs)
        made = args.pp_tokens
        cached, reforward = made / ranks[0]["cached"], made / ranks[0]["reforward"]
        print(f"pp2, {made} greedy tokens after a {length}-token prompt (same tokens: "
              f"{all(r['same'] for r in ranks)}):")
        print(f"  cached, each stage its layers' cache  {cached:8.1f} tokens/s")
        print(f"  a whole forward pass per token        {reforward:8.1f} tokens/s")
        print(f"  ratio {cached / reforward:.1f}x (goal >= 5x)")


if __name__ == "__main__":
    main()
