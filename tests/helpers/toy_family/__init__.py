"""A third model family that lives only in the test suite: a residual tensor-parallel MLP that
learns a smooth function of random points. Importing this package registers it (mm-train finds
it through $MM_TRAIN_FAMILIES=helpers.toy_family); nothing in mm-train names it."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
from mindspore import Tensor, nn, ops

from mm_parallel import ColumnParallelLinear, RowParallelLinear
from mm_parallel.blocks import Linear
from mm_parallel.model_base import ParallelModel
from mm_parallel.moe import MoEConfig, MoELayer, auxiliary_loss
from mm_parallel.ops.device import host_array
from mm_train.recipe import DataSection
from mm_train.registry import BuiltinRecipe, FamilySpec, register
from mm_train.task import FamilyTask

HERE = Path(__file__).resolve().parent


# -- the model (its own "model package") -----------------------------------------------------------

class Block(nn.Cell):
    """x + down(tanh(up(x))); with ``experts`` in the config, x + a top-2 MoE layer instead."""

    def __init__(self, config, topology):
        super().__init__()
        self.mlp = None
        if config.get("experts"):
            self.mlp = MoELayer(MoEConfig(hidden_size=config["hidden"], moe_intermediate_size=config["width"],
                                          num_experts=config["experts"], top_k=2, aux_loss_coef=0.01), topology)
            return
        self.up = ColumnParallelLinear(config["hidden"], config["width"], topology=topology)
        self.down = RowParallelLinear(config["width"], config["hidden"], topology=topology)

    def construct(self, x):
        if self.mlp is not None:
            return x + self.mlp(x)
        return x + self.down(ops.tanh(self.up(x)))


@dataclass
class Output:
    prediction: object
    loss: object


class ToyMLP(ParallelModel):
    """inputs -> embed -> num_layers residual (up, tanh, down) blocks -> one output; MSE loss."""

    layer_prefix = "layers."

    def __init__(self, config, topology=None, chunk: int = 0, pipeline_num_layers=None):
        super().__init__()
        self.config = config = self.load_config(config)
        layers = self.build_stage(topology, chunk, config["num_layers"], pipeline_num_layers)
        self.embed = Linear(config["inputs"], config["hidden"]) if self.is_first else None
        self.layers = nn.CellList([Block(config, self.topology) for _ in layers])
        self.head = Linear(config["hidden"], 1) if self.is_last else None

    @classmethod
    def load_config(cls, config, overrides=None):
        if not isinstance(config, dict):
            with open(os.path.join(str(config), "config.json")) as f:
                config = json.load(f)
        return {**config, **(overrides or {}), "model_type": "toy_mlp"}

    def write_config(self, path, dtype="float32"):
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(self.config, f)

    def flops(self, batch):
        c = self.config
        return 2 * (c["inputs"] * c["hidden"] + 2 * c["num_layers"] * c["hidden"] * c["width"] + c["hidden"])

    def pipeline_stage(self, x, batch):
        if self.is_first:
            x = self.embed(Tensor(host_array(batch["x"], np.float32)))
        for layer in self.layers:
            x = layer(x)
        return self.head(x) if self.is_last else x

    def pipeline_loss(self, prediction, batch):
        diff = prediction - Tensor(host_array(batch["y"], np.float32))
        return (diff * diff).mean() + auxiliary_loss(self)  # this stage's MoE layers' aux loss (0 without)

    def construct(self, x, y=None):
        self.require_whole_model()
        batch = {"x": x, "y": y}
        prediction = self.pipeline_stage(None, batch)
        return Output(prediction, None if y is None else self.pipeline_loss(prediction, batch))


@dataclass
class ToyLoraConfig:
    r: int = 4
    alpha: float = 8.0
    dropout: float = 0.0
    target_modules: List[str] = field(default_factory=lambda: ["up", "down"])


def parallelize(model, recompute="none", recompute_num_layers=None, lora: Optional[ToyLoraConfig] = None):
    from mm_parallel.lora import apply_lora
    from mm_parallel.recompute import apply_recompute

    if len(model.layers):
        apply_recompute(list(model.layers), recompute, recompute_num_layers)
    if lora is not None:
        apply_lora(model, lora.target_modules, lora.r, lora.alpha, lora.dropout)
    return model


# -- its data and task --------------------------------------------------------------------------

@dataclass
class PointsSection(DataSection):
    kind: str = "points"
    samples: int = 64
    inputs: int = 4
    stall_rank: Optional[int] = None  # fault injection: this rank's data never arrives from stall_at_step on
    stall_at_step: int = 0


class Points:
    """x ~ N(0, 1), y = sin(x . w): the same set from the seed on every rank."""

    def __init__(self, samples: int, inputs: int, seed: int):
        rng = np.random.default_rng(seed)
        self.x = rng.standard_normal((samples, inputs)).astype(np.float32)
        self.y = np.sin(self.x @ rng.standard_normal((inputs, 1))).astype(np.float32)

    def __len__(self):
        return len(self.x)

    def get(self, index: int, epoch: int = 0) -> Dict[str, np.ndarray]:
        return {"x": self.x[index], "y": self.y[index]}


class ToyTask(FamilyTask):
    def __init__(self, recipe, topo):
        from mm_data import BucketBatchSampler, Collator

        super().__init__(recipe, topo)
        self.dataset = Points(recipe.data.samples, recipe.data.inputs, recipe.train.seed)
        self.sampler = BucketBatchSampler(len(self.dataset), recipe.train.global_batch_size, topo.dp.rank,
                                          topo.dp.size, seed=recipe.train.seed)
        self.collate = Collator()

    def inline_config(self):
        return {**self.recipe.model.config, "inputs": self.recipe.data.inputs}

    def stream(self, first_step: int):
        data = self.recipe.data
        for step, batches in enumerate(super().stream(first_step), first_step + 1):
            if self.topo.rank == data.stall_rank and step >= data.stall_at_step:
                time.sleep(3600)  # a loader stuck on a dead file system: no error, no progress
            yield batches

    @staticmethod
    def tokens(batch) -> int:
        return len(batch["x"])


SPEC = register(FamilySpec(
    name="toy_mlp",
    description="a residual tensor-parallel MLP (test suite only)",
    models={"toy_mlp": "helpers.toy_family:ToyMLP"},
    task=ToyTask,
    data_sections={"points": PointsSection},
    plan="helpers.toy_family:parallelize",
    lora_config="helpers.toy_family:ToyLoraConfig",
    extra="all",
    recipes=(BuiltinRecipe("toy_tiny", str(HERE / "toy_tiny.yaml"), "the toy MLP on random points",
                           "1-2 CPU processes"),),
))
