"""Models at the shipped recipes' per-rank widths, 1-2 layers, for the device-path step at real shapes.

A recipe's per-rank shapes are what its kernels see on one rank: attention heads and kv heads
divided by tp x the Ulysses degree (head sizes unchanged); the VL towers run whole on every rank
(their widths, heads and patch sizes as published); the vocabulary 4,096, 8 experts (top 2) where
there are experts, each of the published width. The model here is that rank's slice as a whole
model (hidden = heads per rank x head size), one transformer layer (two in the towers, one
windowed and one whole), built from the hub's config.json shape fields
(tests/mm_train/data/hub_configs.json) over the family's tiny test config (its special tokens).
Dense MLPs are MLP wide: swiglu's one restriction is an even width, and at the published widths
(18,944 in Qwen2.5-VL-7B's language model) the step took 3 minutes here instead of seconds.
"""

from __future__ import annotations

import numpy as np
from helpers.hub_folders import HUB_CONFIGS

VOCAB, EXPERTS, TOP_K, MLP = 4096, 8, 2, 512


def heads_divisor(parallel) -> int:
    """What a recipe's parallel section divides attention heads by: tp x the Ulysses degree."""
    return parallel.tp * parallel.ulysses_size


def _text(hub_text: dict, tiny_text: dict, parallel) -> dict:
    """The language model's per-rank widths over the tiny text config."""
    heads_div = heads_divisor(parallel)
    head_dim = hub_text.get("head_dim") or hub_text["hidden_size"] // hub_text["num_attention_heads"]
    heads = hub_text["num_attention_heads"] // heads_div
    text = dict(tiny_text, num_hidden_layers=1, num_attention_heads=heads, hidden_size=heads * head_dim,
                num_key_value_heads=max(1, hub_text["num_key_value_heads"] // heads_div), intermediate_size=MLP,
                vocab_size=VOCAB)
    text.pop("layer_types", None)  # the tiny config's per-layer list: rebuilt for one layer
    if "head_dim" in tiny_text:
        text["head_dim"] = head_dim
    rope = dict(text.get("rope_parameters") or {})
    rope["mrope_section"] = (hub_text.get("rope_scaling") or hub_text.get("rope_parameters"))["mrope_section"]
    text["rope_parameters"] = rope
    if "num_experts" in hub_text:
        text.update(num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=hub_text[
            "moe_intermediate_size"], decoder_sparse_step=1, mlp_only_layers=[])
    return text


def _vision(hub_vision: dict, tiny_vision: dict, out_hidden: int) -> dict:
    """The tower as published (it runs whole on every rank), 2 blocks."""
    keep = ("hidden_size", "num_heads", "patch_size", "window_size", "spatial_merge_size", "temporal_patch_size",
            "num_position_embeddings", "in_chans", "in_channels")
    vision = dict(tiny_vision, **{k: hub_vision[k] for k in keep if k in hub_vision}, depth=2,
                  intermediate_size=MLP, out_hidden_size=out_hidden)
    if "fullatt_block_indexes" in tiny_vision:
        vision["fullatt_block_indexes"] = [1]
    if "deepstack_visual_indexes" in tiny_vision:
        vision["deepstack_visual_indexes"] = [1]  # one DeepStack level, into the one language layer
    return vision


def vl_config(hub_key: str, tiny, parallel) -> dict:
    """config.json of the per-rank Qwen2.5-VL / Qwen3-VL (-MoE) model (``tiny``: the test's
    transformers config of the family)."""
    hub, raw = HUB_CONFIGS[hub_key], tiny.to_dict()
    raw["text_config"] = _text(hub["text_config"], raw["text_config"], parallel)
    raw["vision_config"] = _vision(hub["vision_config"], raw["vision_config"], raw["text_config"]["hidden_size"])
    return raw


def omni_config(hub_key: str, tiny, parallel) -> dict:
    """config.json of the per-rank Qwen2.5-Omni thinker (audio tower as published, 2 layers)."""
    hub, raw = HUB_CONFIGS[hub_key]["thinker_config"], tiny.to_dict()
    raw["text_config"] = _text(hub["text_config"], raw["text_config"], parallel)
    hidden = raw["text_config"]["hidden_size"]
    raw["vision_config"] = _vision(hub["vision_config"], raw["vision_config"], hidden)
    audio = hub["audio_config"]
    raw["audio_config"] = dict(raw["audio_config"], **{k: audio[k] for k in (
        "num_mel_bins", "encoder_attention_heads", "d_model", "n_window", "max_source_positions")},
        encoder_ffn_dim=MLP, encoder_layers=2, output_dim=hidden)
    return raw


def padded(inputs: dict, pad: int, relabel) -> dict:
    """``inputs`` with every row left-padded by ``pad`` tokens and one more row of padding alone
    (attention_mask 0, no media): what a collator padding to the left makes of a short batch;
    ``relabel`` recomputes the labels (and token types) from ids and mask."""
    ids = inputs["input_ids"]
    mask = inputs.get("attention_mask", np.ones_like(ids))
    rows, length = ids.shape
    new_ids = np.zeros((rows + 1, length + pad), ids.dtype)
    new_mask = np.zeros_like(new_ids)
    new_ids[:rows, pad:], new_mask[:rows, pad:] = ids, mask
    out = {k: v for k, v in inputs.items() if k not in ("labels", "mm_token_type_ids")}
    out.update(input_ids=new_ids, attention_mask=new_mask)
    return relabel(out)


def dit_config(hub_key: str, parallel) -> dict:
    """config.json of the per-rank Wan / CogVideoX transformer: heads over tp x Ulysses at the
    published head size, the published patches, channels and text width, one block."""
    hub = HUB_CONFIGS[hub_key]
    raw = dict(hub, num_attention_heads=hub["num_attention_heads"] // heads_divisor(parallel), num_layers=1)
    if "ffn_dim" in raw:  # Wan's GELU MLP: no kernel restriction on its width
        raw["ffn_dim"] = MLP
    return raw


def dit_batch(raw: dict, rng: np.random.Generator) -> dict:
    """Two clips of 2 latent frames (1.5: one temporal patch) of 16 x 16 latent pixels and 16 text
    tokens at the model's text width (the pipelines pad the text with zeros: no mask), a target."""
    frames, size = 2, (16, 16)
    if "text_dim" in raw:  # Wan: latents (B, C, F, H, W)
        shape, text_dim, out = (2, raw["in_channels"], frames) + size, raw["text_dim"], raw["out_channels"]
        target = (2, out, frames) + size
    else:  # CogVideoX: latents (B, F, C, H, W); the text rows are max_text_seq_length
        shape, text_dim = (2, frames, raw["in_channels"]) + size, raw["text_embed_dim"]
        target = (2, frames, raw["out_channels"]) + size
    text = raw.get("max_text_seq_length", 16)
    batch = {"hidden_states": rng.standard_normal(shape).astype(np.float32),
             "encoder_hidden_states": rng.standard_normal((2, text, text_dim)).astype(np.float32),
             "timestep": rng.integers(0, 1000, 2).astype(np.int64),
             "target": rng.standard_normal(target).astype(np.float32)}
    if raw.get("ofs_embed_dim"):
        batch["ofs"] = np.full((1,), 2.0, np.float32)
    return batch
