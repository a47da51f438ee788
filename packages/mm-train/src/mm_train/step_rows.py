"""From a training step's figures to its metrics row, read from the device once per written row.

A step's figures are its loss, gradient norm, skip and overflow flags, loss scale and token
count. On the CPU path they are host numbers already (its host shortcuts read them as they go).
On the device path (Ascend, or its stand-ins: `mm_parallel.ops.device.use_fused`) they are (1,)
device tensors, and reading one waits for the device and crosses to the host. So the loop hands
each step's figures to `Rows.add` and calls `Rows.write` only when a row is due — a log step
(``train.log_every``), an evaluation or sample step, a checkpoint, the last step: the figures of
every step since the last written row are then read in one transfer. With ``log_every = k`` that
is one read per k steps and none between them; with 1, one per step (the logged loss).

What depends on the values waits for that read too: the non-finite count that stops a run
(``train.max_nonfinite_steps``, checked at each written row), the throughput (each step's own
time, measured without waiting for the device: between reads it is the time to queue the step,
and the time of the step that reads includes the wait) and the progress line.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Callable, Dict, List, Optional

import mindspore as ms
from mindspore import Tensor, ops

# rows of packed runs (mm_train.loop); batch_samples: the global batch's samples (a token budget's vary)
PACKING_FIELDS = ("padding_fraction", "tokens_max_over_mean", "batch_samples")
# rows of train.objective dpo (mm_train.preference_step), TRL's names
PREFERENCE_FIELDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                     "logps/rejected", "logps/ref_chosen", "logps/ref_rejected", "errors/chosen", "errors/rejected",
                     "errors/ref_chosen", "errors/ref_rejected")
# rows of train.objective grpo (mm_train.grpo_step), and each reward function's reward/<name>, reward/<name>_std
GRPO_FIELDS = ("reward", "reward_std", "kl", "clip_ratio", "completion_length", "generation_share")
KINDS = {"skipped": bool, "overflow": bool, "tokens": int, "batch_samples": int}  # float unless named here
# tokens cross as float32: exact up to 2^24 per step, rounded beyond (a throughput figure only)


def read_all(rows: List[Dict]) -> List[Dict]:
    """``rows`` with every tensor value replaced by its host number, all read in one transfer."""
    where = [(row, key) for row in rows for key, value in row.items() if isinstance(value, Tensor)]
    if where:
        values = ops.concat([row[key].reshape(-1).astype(ms.float32) for row, key in where]).asnumpy()
        for (row, key), value in zip(where, values):
            row[key] = KINDS.get(key, float)(value)
    return rows


def finite(value):
    """JSON has no nan / inf: a non-finite figure is written as null."""
    return value if value is None or value == value and abs(value) != float("inf") else None


class Progress:
    """The status on stderr: step, bar, loss, speed, time so far and the ETA. On a terminal one
    line redrawn in place; otherwise (a log file, msrun's worker logs the launcher relays) a plain
    line every ``total / 20`` steps, at most ``PLAIN_SECONDS`` apart, and at the last step. The
    ETA is the mean time of the steps after this run's first one (which also pays for warm-up;
    a resumed run's first is the one after its checkpoint) times the steps left."""

    PLAIN_SECONDS = 30.0

    def __init__(self, total: int, enabled: bool, tty: Optional[bool] = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.total, self.enabled, self.clock, self.start = total, enabled, clock, clock()
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.every, self.printed_at = max(1, total // 20), self.start
        self.warm = None  # (step, time) at the end of this run's first step

    def eta(self, step: int, now: float) -> str:
        """"eta 1m05s" (or 2h03m) after ``step`` at ``now``; "eta --" until a second step is timed."""
        if self.warm is None:
            self.warm = (step, now)
        steps, since = step - self.warm[0], now - self.warm[1]
        if step >= self.total:
            return "done"
        if steps <= 0:
            return "eta --"
        left = int(round(since / steps * (self.total - step)))
        hours, rest = divmod(left, 3600)
        return f"eta {hours}h{rest // 60:02d}m" if hours else f"eta {rest // 60}m{rest % 60:02d}s"

    def note(self, text: str) -> None:
        """A line of its own (a validation loss), below the redrawn progress line."""
        if self.enabled:
            print(("\n" if self.tty else "") + text, flush=True, file=sys.stderr)

    def update(self, step: int, loss: float, samples_per_s: float, routing: Optional[Dict] = None):
        if not self.enabled:
            return
        now = self.clock()
        eta = self.eta(step, now)
        if not self.tty and step % self.every and step != self.total and now - self.printed_at < self.PLAIN_SECONDS:
            return
        self.printed_at = now
        done = int(30 * step / self.total)
        moe = ""
        if routing:  # the worst MoE layer's imbalance (max / mean tokens per expert) and dropped share
            moe = (f"  moe imbalance {max(r['imbalance'] for r in routing.values()):4.2f}"
                   f" dropped {max(r['dropped_fraction'] for r in routing.values()):4.1%}")
        line = (f"step {step:>5}/{self.total} [{'#' * done}{'.' * (30 - done)}] loss {loss:8.4f}  "
                f"{samples_per_s:6.1f} samples/s{moe}  {now - self.start:6.1f}s  {eta}")
        if self.tty:
            print("\r" + line, end="\n" if step == self.total else "", flush=True, file=sys.stderr)
        else:
            print(line, flush=True, file=sys.stderr)


class Rows:
    """The metrics rows of a run: ``metrics`` (every step's row), rank 0's metrics.jsonl and
    TensorBoard events at log steps and rows with evaluation results, the progress line, and the
    run's stop after ``max_nonfinite`` skipped steps in a row."""

    def __init__(self, recipe, optimizer, samples: int, dp: int, log=None, board=None, bar=None,
                 memory_bytes=lambda: None):
        """``samples``: per dp rank and step (a packed step's ``batch_samples`` figure, when it has
        one, says it instead); the tokens figure counts the dp group's. ``meter``
        (the run's mm_profiling Throughput) is set before the first row is written."""
        self.recipe, self.optimizer, self.dp, self.meter = recipe, optimizer, dp, None
        self.samples, self.log, self.board, self.bar, self.memory_bytes = samples, log, board, bar, memory_bytes
        self.metrics: List[Dict] = []
        self.pending: List[Dict] = []
        self.bad_in_a_row = self.skipped_total = 0

    def add(self, figures: Dict) -> None:
        """One step's figures: step, seconds, lr, loss, tokens, grad_norm, skipped, overflow,
        loss_scale (numbers or unread device tensors)."""
        figures["mem_bytes"] = self.memory_bytes()
        self.pending.append(figures)

    def write(self, extra: Optional[Dict] = None) -> None:
        """Read the pending steps' figures (one transfer) and make their rows; ``extra`` (routing
        metrics, evaluation results) goes into the last one."""
        steps = read_all(self.pending)
        self.pending = []
        for k, figures in enumerate(steps):
            self._row(figures, extra if k == len(steps) - 1 else None)

    def _row(self, figures: Dict, extra: Optional[Dict]) -> None:
        recipe, optimizer = self.recipe, self.optimizer
        # an fp16 overflow is loss scaling at work (the scale halved), not a bad step, until the scale is spent
        scaling = figures["overflow"] and figures["loss_scale"] > optimizer.config.min_loss_scale
        self.bad_in_a_row = self.bad_in_a_row + 1 if figures["skipped"] and not scaling else 0
        self.skipped_total += int(figures["skipped"])
        step = figures["step"]
        samples = figures["batch_samples"] / self.dp if "batch_samples" in figures else self.samples
        speed = self.meter.record(figures["seconds"], samples=samples, tokens=figures["tokens"] // self.dp)
        row = {"step": step, "loss": finite(figures["loss"]), "grad_norm": finite(figures["grad_norm"]),
               "lr": figures["lr"], "samples_per_s": speed["cluster_samples_per_s"],
               "tokens_per_s": speed["cluster_tokens_per_s"], "mfu": speed["mfu"], "mem_bytes": figures["mem_bytes"],
               "skipped": figures["skipped"]}
        if optimizer.scaling:
            row["loss_scale"] = figures["loss_scale"]
            row["skipped_total"] = self.skipped_total
        row.update({key: value for key, value in figures.items()
                    if key in PACKING_FIELDS + PREFERENCE_FIELDS + GRPO_FIELDS or key.startswith("reward/")})
        row.update(extra or {})
        self.metrics.append(row)
        if self.log is not None and (step % recipe.train.log_every == 0 or "val_loss" in row or "samples" in row):
            self.log.write(json.dumps(row) + "\n")
            self.log.flush()
            if self.board is not None:
                self.board.write(row)
        if self.bar is not None:
            self.bar.update(step, figures["loss"], row["samples_per_s"], row.get("moe"))
        if self.bad_in_a_row >= recipe.train.max_nonfinite_steps:
            raise RuntimeError(f"{self.bad_in_a_row} steps in a row (up to step {step}) had a non-finite loss or "
                               f"gradient and were skipped ({self.skipped_total} in all); lower optim.lr, check the "
                               "data, or raise train.max_nonfinite_steps")
