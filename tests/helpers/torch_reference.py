"""Helpers every parity test shares: the error measure and PEFT adapters for a torch reference."""

from __future__ import annotations

import json
import os

import numpy as np


def rel_err(ours, ref) -> float:
    """max |ours - ref| / max |ref| (the error relative to the tensor's scale)."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / max(np.abs(ref).max(), 1e-30))


def assert_same_state(loaded, reference):
    """Every tensor of the original module, bit for bit, and nothing else."""
    import torch

    want, got = reference.state_dict(), loaded.state_dict()
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def rms_err(ours, ref) -> float:
    """||ours - ref|| / ||ref||: for bf16 comparisons, where the max-based rel_err is one bf16 step of
    the largest value."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(ours - ref) / max(np.linalg.norm(ref), 1e-30))


def write_peft_adapters(path, reference, targets, r: int = 4, alpha: float = 8.0, seed: int = 0):
    """Random PEFT adapters (A and B both non-zero) for every nn.Linear of the torch ``reference``
    whose module path ends with one of ``targets``, named as PEFT names them on that model:
    base_model.model.<module>.lora_A.weight / lora_B.weight."""
    import torch
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for name, module in reference.named_modules():
        if isinstance(module, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets):
            out_features, in_features = module.weight.shape
            key = f"base_model.model.{name}"
            a = rng.standard_normal((r, in_features)) / in_features ** 0.5
            tensors[f"{key}.lora_A.weight"] = a.astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((out_features, r)) * 0.05).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets)}, f)
