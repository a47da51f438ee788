"""`mm-train generate` for the VL families: the greedy answer to a prompt about pictures, videos
and sounds (the same decoding as the answers sampled while training, mm_train.families.vl.samples)."""

from __future__ import annotations

from typing import Dict

from mm_train import samples
from mm_train.families.vl import samples as vl_samples


def generate_answer(args, spec, folder, recipe, topo, chunks) -> Dict:
    """Print the answer (rank 0) and write it to --out when given; returns {"answer": text}."""
    task = spec.task
    tokenizer, processors, system = task.answer_kit(recipe, folder)
    with samples.inference(chunks):
        media = {kind: [path] if path else [] for kind, path in
                 (("images", args.image), ("videos", args.video), ("audios", args.audio))}
        text = vl_samples.answer(chunks, topo, tokenizer, processors, system, args.prompt, media,
                                 args.max_new_tokens, task.dataset_class())
    if topo.rank == 0:
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    return {"answer": text}
