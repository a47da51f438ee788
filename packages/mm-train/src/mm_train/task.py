"""A training task: what a family gives the shared loop (mm_train.loop) — its model and its data.

`Task` is the protocol the loop calls. `FamilyTask` implements the parts every family shares:
the model class from the family's registry entry (by the config.json of ``model.path`` or the
inline config), the plan (recompute, LoRA, freezing) through the family's ``parallelize``, the
data position (the sampler's state at a step) and the stream of this rank's micro-batches
through mm-data's resumable loader. A family's task sets ``dataset``, ``sampler`` and ``collate``
and says how many tokens a micro-batch holds. With a held-out split (recipe ``eval``) it builds its
sampler over `training_indices` and `validation_batches` yields the held-out micro-batches
(mm_train.evaluation); a family with its own data for ``eval.path`` overrides `validation_source`.
"""

from __future__ import annotations

import inspect
import os
from typing import Callable, Dict, Iterator, List, Optional, Protocol, Tuple

from mm_train.evaluation import micro_batch_stream, training_split
from mm_train.micro_batches import MicroBatches

# Deferred imports: MindSpore and mm-parallel (the CLI starts without loading MindSpore); mm-data,
# transformers (optional: a missing one is named when a run needs it).


def plan_options(recipe, lora) -> dict:
    """The keywords of the family's ``parallelize`` for ``recipe``: recompute, LoRA (a config or
    None), freezing (given only when the recipe freezes: not every family's plan takes it)."""
    spec = recipe.model
    options = dict(recompute=spec.recompute, recompute_num_layers=spec.recompute_num_layers, lora=lora)
    if spec.freeze:
        options["freeze"] = spec.freeze
    return options


class Task(Protocol):
    """What the loop needs of a family (see `FamilyTask`)."""

    model_class: type

    def inline_config(self): ...  # the recipe's inline config, completed (vocabulary, special tokens)

    def lora_config(self, **options): ...  # the family's LoRA config (its default target modules)

    def plan(self, model, lora) -> None: ...  # recompute, LoRA, freezing on one model chunk

    def stream(self, first_step: int) -> Iterator[List[Dict]]: ...  # this rank's micro-batches per step

    def position(self, step: int) -> dict: ...  # the data position saved with a checkpoint

    def tokens(self, batch: Dict) -> int: ...  # real tokens of a micro-batch (throughput)

    def samples(self, batch: Dict) -> int: ...  # the samples of a micro-batch (a packed row holds several)

    def packed(self) -> bool: ...  # micro-batches are packed rows (their metrics: padding, balance)

    def loss_normalization(self) -> Optional[str]: ...  # token | sample | None (mm_train.loss_share)

    def model_inputs(self, batch: Dict) -> Dict: ...  # a micro-batch as forward keywords

    def flops_per_sample(self, model, batch: Dict) -> float: ...  # forward FLOPs of one sample (MFU)

    def bad_samples(self) -> List[Tuple[str, str]]: ...  # (source, reason) of every sample this rank skipped

    def data_files(self) -> Tuple[List[str], List[str]]: ...  # (annotation files, media files): the fingerprint

    def validation_batches(self) -> Iterator[List[Dict]]: ...  # this rank's held-out micro-batches (eval)


def load_tokenizer(path: str, **special_tokens):
    """A transformers tokenizer from a model folder, or from a tokenizer.json file with the given
    special tokens (pad_token=..., eos_token=...); no remote code."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if not path:
        raise ValueError("no tokenizer: set data.tokenizer (a folder or a tokenizer.json) or model.path")
    if os.path.isfile(path):
        return PreTrainedTokenizerFast(tokenizer_file=path, **special_tokens)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=False)


def once_on_rank_zero(topo, make: Callable):
    """Run ``make`` on global rank 0 (e.g. write a built-in data set), then wait for it everywhere."""
    if topo.rank == 0:
        make()
    if topo.world_size > 1:
        from mm_parallel import comm

        comm.barrier(topo.world)


class FamilyTask:
    """The shared part of a family's task; see the module docstring."""

    dataset = sampler = None
    collate: Optional[Callable] = None
    held_out = None  # the indices of the training set held out for validation (eval.fraction), or None

    def __init__(self, recipe, topo):
        self.recipe, self.topo, self.spec = recipe, topo, recipe.family
        self.validation_skips: List[Tuple[str, str]] = []  # bad samples met by validation
        self.validation_described = False  # the log has named the validation split's size
        self.model_json = recipe.model_source.config_json()  # the model class and the family's task use it
        self.model_class = self.spec.recipe_model_class(recipe, self.model_json)
        self.parallelize = self.spec.plan_function()
        if recipe.model.freeze and "freeze" not in inspect.signature(self.parallelize).parameters:
            raise ValueError(f"model.freeze is not available for family {self.spec.name}: its plan freezes nothing "
                             "(use model.lora to train adapters only)")

    def inline_config(self):
        return dict(self.recipe.model.config)

    def lora_config(self, **options):
        return self.spec.lora_config_class()(**options)

    def plan(self, model, lora) -> None:
        self.parallelize(model, **plan_options(self.recipe, lora))

    def training_indices(self, num_samples: int):
        """The samples training may draw: all (None) unless eval.fraction holds some out."""
        train, self.held_out = training_split(self.recipe, num_samples)
        return train

    def validation_source(self):
        """(data set, shape keys or None, indices or None) of the validation split: the held-out
        part of the training set; a family that reads eval.path overrides this."""
        if self.recipe.eval.path:
            raise ValueError(f"eval.path is not supported by family {self.spec.name}; use eval.fraction")
        return self.dataset, getattr(self.sampler, "key_of", None), self.held_out

    def validation_inputs(self, batches: List[Dict]) -> List[Dict]:
        """A validation batch's micro-batches as forward keywords."""
        return [self.model_inputs(b) for b in batches]

    def validation_batches(self) -> Iterator[List[Dict]]:
        """This rank's validation micro-batches, batch by batch (mm_train.evaluation)."""
        dataset, keys, indices = self.validation_source()
        return micro_batch_stream(self, dataset, keys, indices, self.validation_inputs)

    def record_bad_samples(self, bad: List[Tuple[str, str]]) -> None:
        """Bad samples met outside the training stream (validation), for OUT/bad_samples.jsonl."""
        self.validation_skips.extend(bad)

    def position(self, step: int) -> dict:
        """The data loader's state at the start of ``step`` (grpo: a batch of prompts serves
        grpo.num_iterations steps)."""
        every = self.recipe.grpo.num_iterations if self.recipe.train.objective == "grpo" else 1
        return self.sampler.state_at(step // every)

    def stream(self, first_step: int) -> Iterator[List[Dict]]:
        """This rank's micro-batches of every step from ``first_step`` on (mm-data's loader:
        ``data.num_workers`` processes, resumed at the step's position)."""
        from mm_data import DataLoader

        loader = DataLoader(self.dataset, self.sampler, self.micro_batches(), num_workers=self.recipe.data.num_workers)
        loader.load_state_dict(self.position(first_step))
        return iter(loader)

    def micro_batches(self) -> Callable:
        """What cuts a rank's share of a step into micro-batches (`MicroBatches` of micro_batch_size)."""
        return MicroBatches(self.collate, self.recipe.train.micro_batch_size)

    def packed(self) -> bool:
        """Whether micro-batches are packed rows (a family data section's ``packing``)."""
        return bool(getattr(self.recipe.data, "packing", False))

    def loss_normalization(self) -> Optional[str]:
        """train.loss_normalization; unset, token with packed data (mm_train.loss_share)."""
        return self.recipe.train.loss_normalization or ("token" if self.packed() else None)

    def model_inputs(self, batch: Dict) -> Dict:
        return batch

    def samples(self, batch: Dict) -> int:
        """A micro-batch's samples: its rows (a family that packs several samples a row says more)."""
        return len(next(iter(batch.values())))

    def flops_per_sample(self, model, batch: Dict) -> float:
        return model.flops(batch)

    def data_files(self) -> Tuple[List[str], List[str]]:
        """(annotation files, media files) the data set reads (mm_train.data_fingerprint); a family
        that lists none has no fingerprint and its resumed runs are not checked."""
        return [], []

    def bad_samples(self) -> List[Tuple[str, str]]:
        """The samples this rank's data set skipped (mm-data's BadInputLog), in the order met."""
        log = getattr(self.dataset, "bad_input", None)
        return (list(log.skipped) if log is not None else []) + self.validation_skips
