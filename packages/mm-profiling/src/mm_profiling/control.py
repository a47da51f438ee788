"""Profiler control at step boundaries: exactly steps start..end, on exactly the chosen ranks.

    profiler = StepProfiler(config, rank=topology.rank)
    for step in range(1, steps + 1):
        profiler.before_step(step)
        train_step()
        profiler.after_step(step)
    profiler.close()

Static collection starts MindSpore's profiler before ``start_step`` and stops it after
``end_step``; the trace (``trace_view.json``, operator tables) is written under
``save_path/rank_<r>`` by ``tensorboard_trace_handler``. Ascend-only options are passed through on
Ascend and ignored elsewhere with one warning.

Dynamic collection watches ``save_path/profiler_config.json`` (written at start with the window
disabled, ``{"start_step": -1, "end_step": -1}``): when a person sets a window of future steps
while training runs, it is picked up at the next step boundary and captured like a static one;
editing it again arms another window. (MindSpore's DynamicProfilerMonitor serves Ascend's own
tooling; this watcher works the same on every device.)
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Optional

import mindspore as ms

from mm_profiling.config import EXPERIMENTAL_OPTIONS, PROFILE_OPTIONS, ProfileConfig

log = logging.getLogger(__name__)


def ascend_arguments(config: ProfileConfig):
    """(profile() keywords, _ExperimentalConfig keywords) of ``profile.ascend``, typed as MindSpore
    checks them: aic_metrics an AicoreMetrics member (given as its name, MindSpore would reset it
    to the default with only a log warning), hbm_ddr / pcie to profile() itself."""
    from mindspore.profiler import AicoreMetrics

    experimental = {k: v for k, v in config.ascend.items() if k in EXPERIMENTAL_OPTIONS}
    if "aic_metrics" in experimental:
        experimental["aic_metrics"] = AicoreMetrics(experimental["aic_metrics"])
    return {k: v for k, v in config.ascend.items() if k in PROFILE_OPTIONS}, experimental


def _profiler(config: ProfileConfig, out: str):
    from mindspore.profiler import (
        ProfilerActivity,
        ProfilerLevel,
        _ExperimentalConfig,
        profile,
        tensorboard_trace_handler,
    )

    on_ascend = ms.get_context("device_target") == "Ascend"
    switches, extra = {}, {}
    if config.ascend and not on_ascend:
        log.warning("profile.ascend options %s apply on Ascend only; ignored on %s", sorted(config.ascend),
                    ms.get_context("device_target"))
    elif on_ascend:
        switches, extra = ascend_arguments(config)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.NPU] if on_ascend else [])
    level = [ProfilerLevel.Level0, ProfilerLevel.Level1, ProfilerLevel.Level2][config.level]
    return profile(activities=activities, with_stack=config.with_stack, profile_memory=config.with_memory,
                   record_shapes=config.record_shapes, start_profile=False,
                   on_trace_ready=tensorboard_trace_handler(out), **switches,
                   experimental_config=_ExperimentalConfig(profiler_level=level, **extra))


class StepProfiler:
    """Starts and stops collection at step boundaries; a no-op on ranks the config leaves out."""

    def __init__(self, config: ProfileConfig, rank: int = 0):
        self.config, self.rank = config, rank
        self.active = config.profiles_rank(rank)
        self.out = os.path.join(config.save_path, f"rank_{rank}")
        self._prof: Optional[object] = None
        self.captured = []  # steps collected, in order
        self._steps = []  # wall-clock boundaries of the steps of the current capture
        self.window = (config.start_step, config.end_step) if config.type == "static" else (-1, -1)
        self.control_file = os.path.join(config.save_path, "profiler_config.json")
        self._seen = None
        if self.active and config.type == "dynamic":
            os.makedirs(config.save_path, exist_ok=True)
            if not os.path.exists(self.control_file):
                _write_json(self.control_file, {"start_step": -1, "end_step": -1})

    def _poll(self, step: int) -> None:
        """Dynamic mode: take a new window from the control file if it changed since last seen."""
        try:  # the content, not the mtime: two quick edits may share a timestamp
            with open(self.control_file) as f:
                text = f.read()
        except FileNotFoundError:
            return
        if text == self._seen:
            return
        self._seen = text
        try:
            values = json.loads(text)
            start, end = int(values["start_step"]), int(values["end_step"])
        except (ValueError, KeyError, TypeError) as error:  # a half-saved or wrong edit: keep the old window
            log.warning("%s is not a valid profiler window (%s); keeping %s", self.control_file, error, self.window)
            return
        if start == -1 or (start >= step and end >= start):
            self.window = (start, end)
        else:
            log.warning("profiler window %s..%s ignored: it must start at or after step %d and end after it starts",
                        start, end, step)

    def before_step(self, step: int) -> None:
        if self.active and self.config.type == "dynamic" and self._prof is None:
            self._poll(step)
        if self.active and step == self.window[0] and self._prof is None:
            os.makedirs(self.out, exist_ok=True)
            self._prof = _profiler(self.config, self.out)
            self._prof.start()
        if self._prof is not None:
            self.captured.append(step)
            self._steps.append({"step": step, "start_us": time.time() * 1e6})

    def after_step(self, step: int) -> None:
        if self._prof is not None:
            self._steps[-1]["end_us"] = time.time() * 1e6
            if step == self.window[1]:
                self.close()

    def close(self) -> None:
        """Stop collecting (and write the trace) if collecting; safe to call twice."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.stop()
            # step boundaries on the trace's clock (Unix microseconds), for the report's per-step table
            _write_json(os.path.join(self.out, f"steps_{self._steps[0]['step']}.json"), {"steps": self._steps})
            self._steps = []


def _write_json(path: str, values: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(values, f)
    os.replace(tmp, path)
