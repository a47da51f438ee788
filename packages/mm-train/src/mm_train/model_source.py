"""The model a recipe trains, read once: model.path's config.json, or the inline config.

Preflight, the planner and the task all need the model's config.json mapping (its shapes, its
model_type); each asks the recipe's one `ModelSource`, which reads the file the first time and
keeps it, so a launch reads a model folder's config.json once.
"""

from __future__ import annotations

import json
import os
from typing import Optional


class ModelSource:
    """``model``: the recipe's model section (path and / or inline config)."""

    def __init__(self, model):
        self.path: Optional[str] = model.path
        self._inline = dict(model.config)
        self._config_json: Optional[dict] = None

    def config_json(self) -> dict:
        """The config.json mapping: model.path's (read now, once), else the inline config as written
        (a copy each time: callers may complete it)."""
        if not self.path:
            return dict(self._inline)
        if self._config_json is None:
            file = os.path.join(self.path, "config.json")
            if not os.path.isfile(file):
                raise FileNotFoundError(f"model.path {self.path} has no config.json; point it at a Hugging Face / "
                                        "diffusers model folder")
            with open(file) as f:
                self._config_json = json.load(f)
        return dict(self._config_json)
