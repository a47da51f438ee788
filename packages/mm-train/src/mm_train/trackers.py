"""Experiment trackers beside TensorBoard: Weights & Biases, SwanLab, MLflow (rank 0 only).

Each tracker the recipe names under ``logging`` gets what TensorBoard gets (`row_scalars`: every
row of metrics.jsonl as ``train/<figure>``, ``eval/val_loss``, ``moe/<layer>/<figure>``, at the
row's step), the recipe as the run's config, and each validation sample's contact sheet as an
image ``samples/<name>``:

- ``logging.wandb: {project, name, mode: online | offline}`` — files under OUT/wandb;
- ``logging.swanlab: {project, name, mode: cloud | local}`` — local logs under OUT/swanlog;
- ``logging.mlflow: {tracking_uri, experiment, name}`` — default a file store at OUT/mlruns.

A resumed run continues the same tracker run (its id kept in OUT/trackers.json); the rows after
the checkpoint's step are logged again as metrics.jsonl logs them. Each library is an optional
extra of mm-train (``mm-train[wandb]``, ``[swanlab]``, ``[mlflow]``); a recipe naming a missing
one is refused before launch with the install line.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional

from mm_train import tensorboard_log
from mm_train.tensorboard_log import row_scalars

# Deferred imports: wandb, swanlab, mlflow (optional extras).

MODULES = {"wandb": "wandb", "swanlab": "swanlab", "mlflow": "mlflow"}
IDS = "trackers.json"


@dataclass
class WandbSection:
    project: str = "mm-train"
    name: Optional[str] = None  # default: the output folder's name
    mode: str = "online"  # online | offline (files under OUT/wandb, `wandb sync` later)

    def __post_init__(self):
        if self.mode not in ("online", "offline"):
            raise ValueError(f"logging.wandb.mode {self.mode!r}: use online or offline")


@dataclass
class SwanlabSection:
    project: str = "mm-train"
    name: Optional[str] = None
    mode: str = "cloud"  # cloud | local (logs under OUT/swanlog)

    def __post_init__(self):
        if self.mode not in ("cloud", "local"):
            raise ValueError(f"logging.swanlab.mode {self.mode!r}: use cloud or local")


@dataclass
class MlflowSection:
    tracking_uri: Optional[str] = None  # default: a file store at OUT/mlruns
    experiment: str = "mm-train"
    name: Optional[str] = None


SECTIONS = {"wandb": WandbSection, "swanlab": SwanlabSection, "mlflow": MlflowSection}


def missing_extras(logging) -> List[str]:
    """Install lines of the trackers the recipe names whose library is not installed."""
    return [f"logging.{name} needs {module}: pip install 'mm-train[{name}]'" for name, module in MODULES.items()
            if getattr(logging, name) is not None and importlib.util.find_spec(module) is None]


class _RunTracker:
    """A tracker whose run object logs dicts at a step and finishes (W&B's and SwanLab's alike);
    ``media`` wraps an image for it."""

    run = media = None

    def write(self, scalars: Dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def image(self, tag: str, image, step: int) -> None:
        self.run.log({tag: self.media(image)}, step=step)

    def close(self) -> None:
        self.run.finish()


class WandbTracker(_RunTracker):
    def __init__(self, section: WandbSection, recipe, run_id: Optional[str]):
        import wandb

        self.media = wandb.Image
        self.run = wandb.init(project=section.project, name=section.name or _name(recipe), mode=section.mode,
                              dir=recipe.output_dir, config=recipe.to_dict(), id=run_id, resume="allow" if run_id
                              else None, reinit="create_new")
        self.id = self.run.id


class SwanlabTracker(_RunTracker):
    def __init__(self, section: SwanlabSection, recipe, run_id: Optional[str]):
        import swanlab

        self.media = swanlab.Image
        self.run = swanlab.init(project=section.project, name=section.name or _name(recipe), config=recipe.to_dict(),
                                mode="online" if section.mode == "cloud" else "local",
                                log_dir=os.path.join(recipe.output_dir, "swanlog"), id=run_id,
                                resume="allow" if run_id else None, reinit=True)
        self.id = getattr(self.run, "id", None)


class MlflowTracker:
    def __init__(self, section: MlflowSection, recipe, run_id: Optional[str]):
        from mlflow import MlflowClient

        uri = section.tracking_uri or "file:" + os.path.abspath(os.path.join(recipe.output_dir, "mlruns"))
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3.18 keeps the file store "in maintenance" and refuses it unless asked; it is
            # the one local store mlflow-skinny can write (a database store needs SQLAlchemy)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            experiment = self.client.get_experiment_by_name(section.experiment)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(section.experiment))
            run_id = self.client.create_run(experiment_id, run_name=section.name or _name(recipe)).info.run_id
            self.client.log_dict(run_id, recipe.to_dict(), "recipe.json")
            self.client.log_batch(run_id, params=_params(recipe.to_dict()))
        self.id = run_id

    def write(self, scalars: Dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        self.client.log_batch(self.id, metrics=[Metric(tag, float(value), 0, step) for tag, value in scalars.items()])

    def image(self, tag: str, image, step: int) -> None:
        self.client.log_image(self.id, image, key=tag.replace("/", "_"), step=step)

    def close(self) -> None:
        self.client.set_terminated(self.id)


TRACKERS = {"wandb": WandbTracker, "swanlab": SwanlabTracker, "mlflow": MlflowTracker}


def _name(recipe) -> str:
    return os.path.basename(os.path.normpath(recipe.output_dir))


def _params(config: Dict, prefix: str = "") -> list:
    """The recipe flattened to MLflow params (dotted keys, values cut to MLflow's 6000 characters)."""
    from mlflow.entities import Param

    out = []
    for key, value in config.items():
        if isinstance(value, dict):
            out += _params(value, f"{prefix}{key}.")
        else:
            out.append(Param(f"{prefix}{key}", json.dumps(value, default=str)[:6000]))
    return out


class Boards:
    """Every place a run's rows go beside metrics.jsonl: the TensorBoard log and the trackers."""

    def __init__(self, recipe, first_step: int):
        self.tensorboard = tensorboard_log.open_for(recipe, first_step, True)
        path = os.path.join(recipe.output_dir, IDS)
        ids = {}
        if first_step and os.path.isfile(path):
            with open(path) as f:
                ids = json.load(f)
        self.trackers = {name: TRACKERS[name](getattr(recipe.logging, name), recipe, ids.get(name))
                         for name in TRACKERS if getattr(recipe.logging, name) is not None}
        if self.trackers:
            with open(path, "w") as f:
                json.dump({name: tracker.id for name, tracker in self.trackers.items()}, f)

    def write(self, row: Dict) -> None:
        if self.tensorboard is not None:
            self.tensorboard.write(row)
        scalars = row_scalars(row)
        for tracker in self.trackers.values():
            tracker.write(scalars, row["step"])

    def add_sample_image(self, name: str, image, step: int) -> None:
        if self.tensorboard is not None:
            self.tensorboard.add_sample_image(name, image, step)
        for tracker in self.trackers.values():
            tracker.image(f"samples/{name}", image, step)

    def close(self) -> None:
        for board in [self.tensorboard, *self.trackers.values()]:
            if board is not None:
                board.close()


def open_for(recipe, first_step: int, writer: bool) -> Optional[Boards]:
    """The run's boards when the recipe asks for any and this rank writes, else None."""
    wanted = recipe.logging.tensorboard or any(getattr(recipe.logging, name) is not None for name in TRACKERS)
    return Boards(recipe, first_step) if writer and wanted else None
