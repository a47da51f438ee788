"""The ``profile:`` section of a recipe, as the reference suite's tools config names it.

    enable: true
    type: static            # static | dynamic (started / stopped by editing a JSON file)
    ranks: [-1]             # global ranks to profile; -1 = all
    level: 0                # 0 | 1 | 2  (MindSpore ProfilerLevel)
    with_stack: false
    with_memory: false
    record_shapes: false
    start_step: 3           # first profiled step (steps count from 1)
    end_step: 4             # last profiled step (inclusive)
    save_path: ./profile
    ascend: {aic_metrics: PipeUtilization, l2_cache: false}   # Ascend-only, ignored elsewhere

``ascend``: aic_metrics (one of AICORE_METRICS, MindSpore's AicoreMetrics values; levels 1 and 2
only: at level 0 MindSpore collects none and resets it), l2_cache, sys_io, sys_interconnection
(MindSpore's _ExperimentalConfig) and hbm_ddr, pcie (its profile() switches): flags true / false.

A wrong key is an error that names the closest valid one; impossible values are errors too.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List

TYPES = ("static", "dynamic")
EXPERIMENTAL_OPTIONS = ("aic_metrics", "l2_cache", "sys_io", "sys_interconnection")  # _ExperimentalConfig's
PROFILE_OPTIONS = ("hbm_ddr", "pcie")  # profile()'s own
ASCEND_ONLY = EXPERIMENTAL_OPTIONS + PROFILE_OPTIONS
# mindspore.profiler.AicoreMetrics' values (named here: the config loads without MindSpore)
AICORE_METRICS = ("PipeUtilization", "ArithmeticUtilization", "Memory", "MemoryL0", "MemoryUB",
                  "ResourceConflictRatio", "L2Cache", "MemoryAccess", "None")


@dataclass
class ProfileConfig:
    enable: bool = False
    type: str = "static"
    ranks: List[int] = field(default_factory=lambda: [-1])
    level: int = 0
    with_stack: bool = False
    with_memory: bool = False
    record_shapes: bool = False
    start_step: int = 1
    end_step: int = 1
    save_path: str = "./profile"
    ascend: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.type not in TYPES:
            raise ValueError(f"profile.type must be one of {list(TYPES)}, got {self.type!r}")
        if self.level not in (0, 1, 2):
            raise ValueError(f"profile.level must be 0, 1 or 2, got {self.level!r}")
        if not isinstance(self.start_step, int) or self.start_step < 1:
            raise ValueError(f"profile.start_step counts from 1, got {self.start_step!r}")
        if not isinstance(self.end_step, int) or self.end_step < self.start_step:
            raise ValueError(f"profile.end_step ({self.end_step}) must be >= start_step ({self.start_step})")
        if not self.ranks or any(not isinstance(r, int) or r < -1 for r in self.ranks):
            raise ValueError(f"profile.ranks must be a list of global ranks, or [-1] for all; got {self.ranks!r}")
        unknown = set(self.ascend) - set(ASCEND_ONLY)
        if unknown:
            raise ValueError(f"profile.ascend has unknown options {sorted(unknown)}; known: {list(ASCEND_ONLY)}")
        self._check_ascend()

    def _check_ascend(self) -> None:
        """Values MindSpore would otherwise reset with only a log warning are errors here."""
        metrics = self.ascend.get("aic_metrics")
        if metrics is not None and metrics not in AICORE_METRICS:
            raise ValueError(f"profile.ascend.aic_metrics must be one of {list(AICORE_METRICS)}, got {metrics!r}")
        if metrics not in (None, "None") and self.level == 0:
            raise ValueError(f"profile.ascend.aic_metrics={metrics} needs profile.level 1 or 2: at level 0 MindSpore "
                             "collects no AI Core metrics (it would reset the option)")
        flags = [k for k, v in self.ascend.items() if k != "aic_metrics" and not isinstance(v, bool)]
        if flags:
            raise ValueError(f"profile.ascend {flags} are switches: true or false")

    @classmethod
    def from_dict(cls, values: Dict[str, Any]) -> "ProfileConfig":
        """From a recipe's mapping; an unknown key names the closest valid one."""
        names = [f.name for f in fields(cls)]
        for key in values:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {names}"
                raise ValueError(f"profile has no key {key!r}{hint}")
        return cls(**values)

    def profiles_rank(self, rank: int) -> bool:
        return self.enable and (-1 in self.ranks or rank in self.ranks)

    def profiles_step(self, step: int) -> bool:
        return self.start_step <= step <= self.end_step
