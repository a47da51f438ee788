"""Model folders of the published checkpoints' shapes (tests/mm_train/data/hub_configs.json):
what `mm-train plan`, preflight and the doctor read of a real-size recipe's model.path."""

from __future__ import annotations

import json
import os
from pathlib import Path

HUB_CONFIGS = json.loads((Path(__file__).parents[1] / "mm_train" / "data" / "hub_configs.json").read_text())


def write_hub_folder(folder, key: str) -> str:
    """``key``'s folder at ``folder``: its config.json, or for a diffusers pipeline (an entry holding
    model_index.json) the index and each component's config.json the file lists."""
    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    entry = HUB_CONFIGS[key]
    if "model_index.json" not in entry:
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(entry, f)
        return folder
    with open(os.path.join(folder, "model_index.json"), "w") as f:
        json.dump(entry["model_index.json"], f)
    for name in entry["model_index.json"]:
        if f"{key}/{name}" in HUB_CONFIGS:
            write_hub_folder(os.path.join(folder, name), f"{key}/{name}")
    return folder
