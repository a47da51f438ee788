"""What an importer hands back: the recipe as a YAML file holds it, and every setting it could not
carry over with the reason (written as comments at the top of the recipe, and printed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import yaml


@dataclass
class Imported:
    source: str  # what was read, for the recipe's header
    kind: str  # llamafactory | mindspeed
    recipe: Dict[str, Any] = field(default_factory=dict)
    left_out: List[Tuple[str, str]] = field(default_factory=list)  # (setting, why it is not in the recipe)
    not_needed: List[str] = field(default_factory=list)  # read, and only the other tool's own machinery
    world_size: Optional[int] = None  # the source's processes, when it says

    def set(self, dotted: str, value: Any) -> None:
        """recipe[a][b] = value for dotted 'a.b'."""
        *sections, key = dotted.split(".")
        place = self.recipe
        for section in sections:
            place = place.setdefault(section, {})
        place[key] = value

    def get(self, dotted: str, default: Any = None) -> Any:
        place: Any = self.recipe
        for part in dotted.split("."):
            if not isinstance(place, dict) or part not in place:
                return default
            place = place[part]
        return place

    def leave_out(self, setting: str, reason: str) -> None:
        self.left_out.append((setting, reason))

    def yaml_text(self) -> str:
        header = [f"# Imported by `mm-train import {self.kind}` from {self.source}."]
        if self.left_out:
            header.append("# Not carried over (no mm equivalent, or not readable):")
            header += [f"#   {setting}: {reason}" for setting, reason in self.left_out]
        if self.not_needed:
            header.append(f"# Read, not needed by mm (the other tool's own machinery): {', '.join(self.not_needed)}")
        return "\n".join(header) + "\n" + yaml.safe_dump(self.recipe, sort_keys=False)
