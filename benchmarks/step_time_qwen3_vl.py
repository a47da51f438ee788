"""One Qwen3-VL (dense or MoE) train step (forward, backward, AdamW), ours vs transformers on torch CPU.

    python benchmarks/step_time_qwen3_vl.py [--moe] [--runs 5] [--threads 2] [--vocab 32000]

Same config for both (language hidden 512, 4 layers, 8 heads / 2 kv heads of 64, vision depth 4
with DeepStack after blocks 1 and 2, one 256 x 256 image = 256 patches of 16 = 64 merged tokens,
512 tokens in all; ``--moe``: every layer 8 experts of 352, top 2, the load-balancing loss on),
same random weights, inputs, thread count and update as benchmarks/step_time_qwen2_5_vl.py
(whose two sides, floor and goals it uses). Prints both medians, the floor, the ratios ours / floor
and ours / torch and where our time goes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from _timing import compare_steps
from step_time_qwen2_5_vl import GOALS, floor, inputs, our_side, torch_side


def config(vocab: int, moe: bool):
    import transformers

    text = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                intermediate_size=1408, vocab_size=vocab, rms_norm_eps=1e-6, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [12, 10, 10]})
    if moe:
        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=352, decoder_sparse_step=1,
                    router_aux_loss_coef=0.001, output_router_logits=True)
    cls = transformers.Qwen3VLMoeConfig if moe else transformers.Qwen3VLConfig
    cfg = cls(text_config=text,
              vision_config=dict(depth=4, hidden_size=256, num_heads=4, intermediate_size=512, out_hidden_size=512,
                                 num_position_embeddings=256, deepstack_visual_indexes=[1, 2]),
              image_token_id=vocab - 4, video_token_id=vocab - 3, vision_start_token_id=vocab - 2,
              vision_end_token_id=vocab - 1)
    for c in (cfg, cfg.text_config, cfg.vision_config):
        c._attn_implementation = "eager"
    return cfg


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--moe", action="store_true")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--no-bf16", action="store_true", help="skip the emulated bf16 step")
    args = parser.parse_args()
    import mm_parallel  # noqa: F401  (before any MindSpore op: blocking launch on CPU)
    from mm_models_vl.qwen3_vl.flops import batch_flops

    cfg = config(args.vocab, args.moe)
    name = "Qwen3VLMoeForConditionalGeneration" if args.moe else "Qwen3VLForConditionalGeneration"
    batch = inputs(cfg, patch=16)
    with tempfile.TemporaryDirectory() as path:
        theirs = torch_side(cfg, path, args.threads, name)
        ours, parts = our_side(path, name)
        bf16 = None if args.no_bf16 else our_side(path, name, precision="bf16")[0]
        compare_steps(ours, theirs, batch, args.runs, parts,
                      f"{'Qwen3-VL-MoE (8 experts, top 2)' if args.moe else 'Qwen3-VL'} train step, "
                      f"{batch['input_ids'].shape[1]} tokens (64 image), vocab {args.vocab}, {args.threads} threads",
                      emulated_bf16=bf16, floor=floor(cfg, batch, batch_flops), goals=GOALS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
