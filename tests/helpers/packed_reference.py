"""Packed rows against their samples run one by one in the torch reference.

`pack_samples` joins one-sample inputs into a packed row as `mm_data.vl.pack` does (token fields
end to end, ``attention_mask`` holding each token's sample number, media in order; Omni's audio
features padded to the longest). `reference_of_samples` is the reference's figure for the row:
with ``per_sample`` False transformers' per-token mean over all the samples' answer tokens
(each sample's mean loss times its count, over the total: Megatron's and transformers'
num_items_in_batch), with True the mean of the samples' means; its gradients summed likewise.
"""

from __future__ import annotations

import numpy as np

TOKEN_FIELDS = ("input_ids", "labels", "mm_token_type_ids")
MEDIA_FIELDS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
                "video_second_per_grid")


def counted(inputs) -> int:
    return int((np.asarray(inputs["labels"])[:, 1:] != -100).sum())


def pack_samples(samples):
    packed = {k: np.concatenate([s[k] for s in samples], 1) for k in TOKEN_FIELDS if k in samples[0]}
    packed["attention_mask"] = np.concatenate([np.full(s["input_ids"].shape, k + 1, np.int64)
                                               for k, s in enumerate(samples)], 1)
    for key in MEDIA_FIELDS:
        parts = [s[key] for s in samples if key in s]
        if parts:
            packed[key] = np.concatenate(parts)
    audios = [s for s in samples if "input_features" in s]
    if audios:
        longest = max(s["input_features"].shape[-1] for s in audios)
        pad = lambda a: np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, longest - a.shape[-1])])  # noqa: E731
        packed["input_features"] = np.concatenate([pad(s["input_features"]) for s in audios])
        packed["feature_attention_mask"] = np.concatenate([pad(s["feature_attention_mask"]) for s in audios])
    return packed


def reference_of_samples(model, samples, per_sample: bool = False):
    """(loss, {name: grad}) of the torch reference over ``samples`` run one by one (module docstring)."""
    import torch

    model.zero_grad()
    total = sum(counted(s) for s in samples)
    loss = 0.0
    for s in samples:
        out = model(**{k: torch.from_numpy(np.asarray(v)) for k, v in s.items()})
        share = out.loss / len(samples) if per_sample else out.loss * (counted(s) / total)
        share.backward()
        loss += share.item()
    grads = {n: p.grad.float().numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    return loss, grads
