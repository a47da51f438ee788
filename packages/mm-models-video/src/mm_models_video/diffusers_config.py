"""DiffusersConfig: a diffusers model's config.json as a typed dataclass (the base of each model's).

Read from a diffusers folder (``config.json``), a dict or keywords; written back with diffusers'
``_class_name`` so that diffusers' ``from_pretrained`` reads what we save. Unknown keys are an
error that names the closest valid one (a typo must not silently fall back to a default);
diffusers' bookkeeping keys (``_class_name``, ``_diffusers_version``, ``_name_or_path``) are kept
in ``extra`` and written back.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from typing import ClassVar

DIFFUSERS_VERSION = "0.42.1"  # the diffusers release the parity tests run against


class DiffusersConfig:
    """Mixin of a ``@dataclass`` with an ``extra: dict`` field and the diffusers ``CLASS_NAME``."""

    CLASS_NAME: ClassVar[str] = ""

    @classmethod
    def from_dict(cls, values: dict):
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
                raise ValueError(f"unknown {cls.CLASS_NAME} config key {key!r}{hint}")
        if extra.get("_class_name", cls.CLASS_NAME) != cls.CLASS_NAME:
            raise ValueError(f"config is for {extra['_class_name']}, not {cls.CLASS_NAME}")
        return cls(**kwargs, extra=extra)

    @classmethod
    def load(cls, config):
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
        out = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items() if k != "extra"}
        return {**self.extra, "_class_name": self.CLASS_NAME, "_diffusers_version": DIFFUSERS_VERSION, **out}

    def save(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
