"""What the launcher checks before any process starts: the layout against the model's shapes,
and that the data and its tokenizer / encoders exist.

A tensor-parallel split needs tp to divide what it cuts (heads, key / value heads, FFN and
vocabulary rows), Ulysses needs its degree to divide each tp rank's heads, pipeline stages need
whole layers, expert parallelism whole experts. The model code checks each of these when it is
built — in every worker, ~20 s after launch on this machine, one message among many. A family's
``preflight`` (`mm_train.registry.FamilySpec`) lists the same constraints over its config.json
(from model.path, or the recipe's inline config), and the files its data section names, so that
`check_before_launch` refuses the run at once, one line per problem saying what to change. A key
the config does not hold is not checked here (the model's default applies; the model's own
check remains).
"""

from __future__ import annotations

import os
from typing import List, Optional

from mm_train import tensorboard_log, trackers

# Deferred imports: mm-data (an optional package; only sharded data is opened before launch).


def divisors(n: int, limit: int = 64) -> str:
    """n's divisors up to ``limit`` (the sizes a parallel group takes), as a list to choose from."""
    found = [str(d) for d in range(1, min(n, limit) + 1) if n % d == 0]
    return ", ".join(found) + (f" (divisors up to {limit})" if n > limit else "")


def require_divisible(problems: List[str], what: str, value: Optional[int], knob: str, size: int) -> None:
    """Note a problem when ``size`` (the layout's ``knob``) does not divide ``value`` (the model's ``what``)."""
    if value is None or size <= 1 or value % size == 0:
        return
    problems.append(f"{what}={value} is not divisible by {knob}={size}; choose {knob} among {divisors(value)}")


def attention_rules(problems: List[str], prefix: str, heads: Optional[int], kv_heads: Optional[int], parallel) -> None:
    """tp divides the heads and key / value heads; Ulysses divides each tp rank's heads."""
    require_divisible(problems, f"{prefix}num_attention_heads", heads, "parallel.tp", parallel.tp)
    require_divisible(problems, f"{prefix}num_key_value_heads", kv_heads, "parallel.tp", parallel.tp)
    u = parallel.ulysses_size
    if heads and parallel.tp and heads % parallel.tp == 0 and u > 1 and (heads // parallel.tp) % u:
        problems.append(f"Ulysses context parallelism splits each tp rank's {heads // parallel.tp} heads over {u} "
                        f"ranks ({prefix}num_attention_heads={heads} / tp={parallel.tp}); choose a cp (or "
                        "ulysses_degree) dividing it, or parallel.cp_algo=ring")


def layer_rules(problems: List[str], what: str, layers: Optional[int], parallel) -> None:
    """pp x vpp stages of whole, equal layer counts, or parallel.pp_layers summing to the layers."""
    stages = parallel.pp * parallel.vpp
    if layers is None or stages <= 1:
        return
    if parallel.pp_layers is not None:
        total = sum(sum(row) if isinstance(row, tuple) else row for row in parallel.pp_layers)
        if total != layers:
            problems.append(f"parallel.pp_layers {_as_lists(parallel.pp_layers)} holds {total} layers, the model "
                            f"has {what}={layers}: give counts summing to {layers}")
        return
    if layers % stages:
        problems.append(f"{what}={layers} layers cannot be cut evenly into pp x vpp = {parallel.pp} x "
                        f"{parallel.vpp} = {stages} stages; choose pp x vpp among {divisors(layers)}, or list "
                        "the layers of each stage in parallel.pp_layers")


def _as_lists(value):
    return [_as_lists(v) for v in value] if isinstance(value, tuple) else value


def model_config(recipe) -> dict:
    """The model's config.json: model.path's, else the recipe's inline config (as written)."""
    return recipe.model_source.config_json()


def require_exists(problems: List[str], field: str, path: Optional[str], what: str, folder: bool = False) -> None:
    """Note a problem when ``path`` (the recipe's ``field``) is set but is not there."""
    if path and not (os.path.isdir(path) if folder else os.path.exists(path)):
        problems.append(f"{field} {path} does not exist; point it at {what}")


def shard_rules(problems: List[str], data) -> None:
    """Sharded data (data.format other than json): every shard there, whole (sizes, footers), before
    any process starts (`mm_data.shards.ShardSet.open`)."""
    if data.format == "json" or not data.path:
        return
    from mm_data import DataError
    from mm_data.shards import ShardSet

    try:
        ShardSet.open(data.path, data.format)
    except DataError as error:
        problems.append(f"data.path: {error}")


def check_before_launch(recipe) -> None:
    """Refuse (ValueError, every problem on its own line) a layout the model's shapes cannot hold
    or data the run cannot read."""
    rules = recipe.family.preflight
    problems = rules(recipe, model_config(recipe)) if rules else []
    if recipe.logging.tensorboard and not tensorboard_log.available():
        problems.append(tensorboard_log.EXTRA_HINT)
    problems += trackers.missing_extras(recipe.logging)
    if problems:
        raise ValueError("this run cannot start: " + "\nmm-train: ".join(problems))
