"""WanTransformerConfig: the fields of diffusers' WanTransformer3DModel config.json, typed.

Read from a diffusers folder (``config.json``), a dict or keywords; written back with diffusers'
``_class_name`` so diffusers' ``WanTransformer3DModel.from_pretrained`` reads what we save.
Unknown keys are an error that names the closest valid one (a typo must not silently fall back
to a default); diffusers' bookkeeping keys (``_class_name``, ``_diffusers_version``, ``_name_or_path``)
are accepted and ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass, field
from typing import Optional, Tuple

CLASS_NAME = "WanTransformer3DModel"
DIFFUSERS_VERSION = "0.42.1"  # the diffusers release the parity tests run against


@dataclass
class WanTransformerConfig:
    patch_size: Tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: Optional[int] = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    qk_norm: Optional[str] = "rms_norm_across_heads"
    eps: float = 1e-6
    image_dim: Optional[int] = None  # I2V: CLIP image-embedding width (1280)
    added_kv_proj_dim: Optional[int] = None  # I2V: the image keys / values' input width
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: Optional[int] = None  # FLF2V: learned positions of the two images' tokens
    extra: dict = field(default_factory=dict, repr=False)  # diffusers bookkeeping, kept for saving

    def __post_init__(self):
        self.patch_size = tuple(int(p) for p in self.patch_size)
        if len(self.patch_size) != 3:
            raise ValueError(f"patch_size must be (t, h, w), got {self.patch_size}")
        if self.qk_norm not in (None, "rms_norm_across_heads"):
            raise ValueError(f"qk_norm={self.qk_norm!r} is not supported; Wan2.1 uses 'rms_norm_across_heads'")
        if self.out_channels is None:
            self.out_channels = self.in_channels
        if (self.image_dim is None) != (self.added_kv_proj_dim is None):
            raise ValueError("an I2V model needs both image_dim and added_kv_proj_dim (T2V: neither)")
        if self.added_kv_proj_dim is not None and self.added_kv_proj_dim != self.inner_dim:
            raise ValueError(f"added_kv_proj_dim={self.added_kv_proj_dim} must equal the model width "
                             f"num_attention_heads x attention_head_dim = {self.inner_dim}: the image keys / values "
                             "are projected from the embedded image tokens")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_dict(cls, values: dict) -> "WanTransformerConfig":
        names = [f.name for f in dataclasses.fields(cls) if f.name != "extra"]
        kwargs, extra = {}, {}
        for key, value in values.items():
            if key.startswith("_"):
                extra[key] = value
            elif key in names:
                kwargs[key] = value
            else:
                close = difflib.get_close_matches(key, names, 1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(f"unknown WanTransformer3DModel config key {key!r}{hint}")
        if extra.get("_class_name", CLASS_NAME) != CLASS_NAME:
            raise ValueError(f"config is for {extra['_class_name']}, not {CLASS_NAME}")
        return cls(**kwargs, extra=extra)

    @classmethod
    def load(cls, config) -> "WanTransformerConfig":
        """From a config object, a dict, or a folder / file holding config.json."""
        if isinstance(config, cls):
            return config
        if isinstance(config, dict):
            return cls.from_dict(config)
        path = str(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "extra"}
        out["patch_size"] = list(self.patch_size)
        return {**self.extra, "_class_name": CLASS_NAME, "_diffusers_version": DIFFUSERS_VERSION, **out}

    def save(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
