"""TensorBoard event files of a run (``logging.tensorboard: true``), beside metrics.jsonl.

Rank 0 writes every row it logs to metrics.jsonl as scalars at the row's step: ``train/loss``,
``train/grad_norm``, ``train/lr``, ``train/samples_per_s``, ``train/tokens_per_s``, ``train/mfu``,
``train/mem_bytes`` (and ``train/loss_scale`` under loss scaling), and for MoE runs each numeric
routing figure of each layer as ``moe/<layer>/<figure>``; the validation loss as ``eval/val_loss``
and each sample's contact sheet as the image ``samples/<name>`` (`add_sample_image`). The writer is tensorboardX (the
optional extra ``mm-train[tensorboard]``; no TensorFlow, no torch); a resumed run purges the events
after its checkpoint's step, as metrics.jsonl drops its rows, so the curves do not double back.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Dict, Optional

# Deferred imports: tensorboardX (optional: a missing one is named when a run needs it).

SCALARS = ("loss", "grad_norm", "lr", "samples_per_s", "tokens_per_s", "mfu", "mem_bytes", "loss_scale")
EXTRA_HINT = "logging.tensorboard needs tensorboardX: pip install 'mm-train[tensorboard]'"


def row_scalars(row: Dict) -> Dict[str, float]:
    """{tag: value} of a metrics row: train/<figure>, eval/val_loss, moe/<layer>/<figure> (what
    TensorBoard and the trackers, mm_train.trackers, are given)."""
    def number(value):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    out = {f"train/{key}": row[key] for key in SCALARS if number(row.get(key))}
    if isinstance(row.get("val_loss"), float):
        out["eval/val_loss"] = row["val_loss"]
    for layer, figures in (row.get("moe") or {}).items():
        out.update({f"moe/{layer}/{name}": value for name, value in figures.items() if number(value)})
    return out


def available() -> bool:
    return importlib.util.find_spec("tensorboardX") is not None


def folder_of(recipe) -> str:
    """Where the event files go: logging.tensorboard_dir, else OUT/tensorboard."""
    return recipe.logging.tensorboard_dir or os.path.join(recipe.output_dir, "tensorboard")


class TensorBoardLog:
    """The run's event writer (rank 0 only)."""

    def __init__(self, folder: str, first_step: int = 0):
        try:
            from tensorboardX import SummaryWriter
        except ImportError as error:
            raise ImportError(EXTRA_HINT) from error
        # purge_step: events at steps > first_step from an earlier attempt are dropped by TensorBoard
        self.writer = SummaryWriter(folder, purge_step=first_step + 1 if first_step else None)

    def write(self, row: Dict) -> None:
        for tag, value in row_scalars(row).items():
            self.writer.add_scalar(tag, value, row["step"])
        self.writer.flush()

    def add_sample_image(self, name: str, image, step: int) -> None:
        """A sample's picture (H, W, 3 uint8) at ``step``."""
        self.writer.add_image(f"samples/{name}", image, step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_for(recipe, first_step: int, writer: bool) -> Optional[TensorBoardLog]:
    """The run's TensorBoard log when the recipe asks for one and this rank writes, else None."""
    if not (writer and recipe.logging.tensorboard):
        return None
    return TensorBoardLog(folder_of(recipe), first_step)
