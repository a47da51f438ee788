"""The model a recipe trains, read once: model.path's config.json, or the inline config.

Preflight, the planner and the task all need the model's config.json mapping (its shapes, its
model_type); each asks the recipe's one `ModelSource`, which reads the file the first time and
keeps it, so a launch reads a model folder's config.json once.
"""

from __future__ import annotations

from typing import Optional

from mm_train.registry import read_model_config


class ModelSource:
    """``model``: the recipe's model section (path and / or inline config)."""

    def __init__(self, model):
        self.path: Optional[str] = model.path
        self._inline = dict(model.config)
        self._config_json: Optional[dict] = None

    def config_json(self) -> dict:
        """The config.json mapping: model.path's (read now, once; a diffusers pipeline folder's
        denoiser's, its model_index.json under registry.PIPELINE_KEY), else the inline config as
        written (a copy each time: callers may complete it)."""
        if not self.path:
            return dict(self._inline)
        if self._config_json is None:
            try:
                self._config_json = read_model_config(self.path)[1]
            except FileNotFoundError as error:
                raise FileNotFoundError(f"model.path: {error}") from None
        return dict(self._config_json)
