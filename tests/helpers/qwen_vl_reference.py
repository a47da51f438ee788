"""Tiny Qwen2.5-VL configs, weights and inputs shared by the parity and parallel tests.

The reference is transformers' Qwen2_5_VLForConditionalGeneration on torch CPU (eager attention,
float32). Weights are drawn here with larger spread than transformers' init (std 0.02 makes every
attention nearly uniform and hides mistakes), saved with the reference's own save_pretrained, and
loaded into ours with from_pretrained: the path users take with real checkpoints.
"""

from __future__ import annotations

import numpy as np
from helpers.torch_reference import rel_err, write_peft_adapters  # noqa: F401 (rel_err re-exported)

IMAGE, VIDEO, START, END = 250, 251, 252, 253
PATCH_DIM = 3 * 2 * 14 * 14


def tiny_config(tie: bool = False, **text):
    from transformers import Qwen2_5_VLConfig

    text_config = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=256, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]})
    text_config.update(text)
    config = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                           window_size=56, fullatt_block_indexes=[1], tokens_per_second=4),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
        tie_word_embeddings=tie)
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    return config


def write_reference(path, seed: int = 0, tie: bool = False, **text):
    """A random reference model saved to ``path``; returns it (torch, eval mode, float32)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration as Reference

    torch.manual_seed(seed)
    model = Reference(tiny_config(tie, **text)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 / max(p.shape[-1], 1) ** 0.5 if p.ndim > 1 else 0.1))
    model.save_pretrained(str(path))
    return model


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(path, reference, r: int = 4, alpha: float = 8.0, seed: int = 0):
    """Random PEFT adapters for every LoRA target linear of the torch reference."""
    write_peft_adapters(path, reference, LORA_TARGETS, r, alpha, seed)


def placeholder(token: int, count: int):
    return [START] + [token] * count + [END]


def merged(grid, merge: int = 2) -> int:
    t, h, w = grid
    return t * (h // merge) * (w // merge)


def sample(kind: str, rng: np.random.Generator, patch_dim: int = PATCH_DIM, video_ids=None,
           second_per_grid: float = 1.5):
    """(inputs dict of numpy arrays) for one named case. ``video_ids(grid, rng)``: a video's
    placeholder tokens (default: one run for the whole video, Qwen2.5-VL's); ``second_per_grid``
    None: no second_per_grid_ts (Qwen3-VL)."""
    video_ids = video_ids or (lambda grid, _: placeholder(VIDEO, merged(grid)))
    text = lambda n: rng.integers(3, 240, n).tolist()  # noqa: E731
    images, videos, ids = [], [], []
    if kind == "text":
        ids = text(12)
    if kind in ("image", "image_video"):
        images.append((1, 8, 12))
        ids = text(3) + placeholder(IMAGE, merged(images[0])) + text(4)
    if kind in ("video", "image_video"):
        videos.append((3, 4, 6))
        ids = (ids or text(3)) + video_ids(videos[0], rng) + text(5)
    inputs = {"input_ids": np.array([ids], np.int64)}
    if images:
        inputs["pixel_values"] = rng.standard_normal((sum(np.prod(g) for g in images), patch_dim)).astype(np.float32)
        inputs["image_grid_thw"] = np.array(images, np.int64)
    if videos:
        patches = sum(np.prod(g) for g in videos)
        inputs["pixel_values_videos"] = rng.standard_normal((patches, patch_dim)).astype(np.float32)
        inputs["video_grid_thw"] = np.array(videos, np.int64)
        if second_per_grid is not None:  # 1.5: interval 6 > spatial span, the 5.x rule matters
            inputs["second_per_grid_ts"] = np.array([second_per_grid], np.float32)
    return with_types_and_labels(inputs)


def padded_pair(rng: np.random.Generator):
    """Two samples with different images, right-padded to one length, attention_mask marking pads."""
    grids = [(1, 4, 4), (1, 8, 4)]
    rows = [rng.integers(3, 240, 2).tolist() + placeholder(IMAGE, merged(g)) + rng.integers(3, 240, n).tolist()
            for g, n in zip(grids, (6, 3))]
    length = max(map(len, rows))
    ids = np.zeros((2, length), np.int64)
    mask = np.zeros((2, length), np.int64)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
    inputs = {"input_ids": ids, "attention_mask": mask,
              "pixel_values": rng.standard_normal((sum(np.prod(g) for g in grids), PATCH_DIM)).astype(np.float32),
              "image_grid_thw": np.array(grids, np.int64)}
    return with_types_and_labels(inputs)


def prompt_and_answer(prompt, answer, media=None):
    """One sample's inputs: ``prompt`` + ``answer`` tokens, only the answer's counted (labels)."""
    inputs = {"input_ids": np.array([prompt + answer], np.int64),
              "labels": np.array([[-100] * len(prompt) + answer], np.int64)}
    inputs["mm_token_type_ids"] = (inputs["input_ids"] == IMAGE).astype(np.int64)
    return {**inputs, **(media or {})}


def with_types_and_labels(inputs):
    ids = inputs["input_ids"]
    types = np.zeros_like(ids)
    types[ids == IMAGE], types[ids == VIDEO] = 1, 2
    labels = ids.copy()
    labels[types != 0] = -100
    if "attention_mask" in inputs:
        labels[inputs["attention_mask"] == 0] = -100
    inputs["mm_token_type_ids"] = types
    inputs["labels"] = labels
    return inputs


def reference_forward(model, inputs, backward: bool = True):
    """(loss, logits, {name: grad}) of the torch reference on numpy inputs."""
    import torch

    model.zero_grad()
    kwargs = {k: torch.from_numpy(np.asarray(v)) for k, v in inputs.items()}
    out = model(**kwargs)
    grads = {}
    if backward:
        out.loss.backward()
        grads = {n: p.grad.float().numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.item(), out.logits.detach().float().numpy(), grads


def assert_matches_reference(reference, ours, inputs, grad_rel: float):
    """Loss and logits (real tokens) within 1e-5, every reference gradient within ``grad_rel``
    (rel-err), ours zero where torch has none; returns the reference's gradients."""
    ref_loss, ref_logits, ref_grads = reference_forward(reference, inputs)
    loss, logits, grads = our_forward(ours, inputs)
    valid = inputs.get("attention_mask", np.ones(inputs["input_ids"].shape)).astype(bool)  # pads: no reference value
    assert abs(loss - ref_loss) / abs(ref_loss) <= 1e-5
    assert rel_err(logits[valid], ref_logits[valid]) <= 1e-5
    assert set(ref_grads) <= set(grads), sorted(set(ref_grads) - set(grads))
    errors = {name: rel_err(grads[name], ref_grads[name]) for name in ref_grads}
    assert max(errors.values()) <= grad_rel, sorted(errors.items(), key=lambda kv: -kv[1])[:5]
    unused = set(grads) - set(ref_grads)  # e.g. the vision tower on text-only input: no gradient in torch
    assert all(not np.any(grads[name]) for name in unused)
    return ref_grads


def our_forward(model, inputs, backward: bool = True):
    """(loss, logits, {name: grad}) of ours, parameter names as transformers'."""
    import mindspore as ms

    logits = {}

    def loss_fn():
        out = model(**inputs)
        logits["value"] = out.logits
        return out.loss

    names = {id(p): n for n, p in model.parameters_and_names()}
    params = model.trainable_params()
    if backward:
        loss, grads = ms.value_and_grad(loss_fn, None, params)()
        grads = {names[id(p)]: g.astype(ms.float32).asnumpy() for p, g in zip(params, grads)}
    else:
        loss, grads = loss_fn(), {}
    return float(loss.asnumpy()), logits["value"].asnumpy(), grads
