"""Who owns an output_dir, and what a resumed run may change.

A run's output_dir holds its checkpoints and metrics.jsonl. A new run (no ``--resume``) in a
folder that holds another run's stops before anything is written there (`check_unclaimed`): it
would prune the other run's checkpoints or overwrite its metrics, and a later ``--resume`` could
pick the wrong run. The choices: ``--resume`` (continue that run), another output_dir, or
``--overwrite`` (`clear` removes that run's outputs first).

A resumed run compares its recipe with the one the checkpoint recorded (`resume_changes`): the
layout (parallel.*), the length (train.steps), logging, checkpointing, profiling and the
micro-batch size may change — the numbers stay those of the run being continued; the model and
what decides the data order (data.*, train.seed, train.global_batch_size / _tokens) may not; anything else
(the learning rate, precision ...) is allowed and named in the log.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from importlib import metadata
from typing import Dict, List, Optional, Tuple

from mm_train import checkpoint, data_fingerprint, node_disks
from mm_train.recipe import build_recipe

# Deferred imports: MindSpore and mm-parallel (the CLI starts without loading MindSpore).

RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "loss.png", "bad_samples.jsonl", "recipe.json", "initial_weights",
               "profile", "reference_logps.safetensors")
_FREE = ("parallel.", "train.steps", "train.micro_batch_size", "train.log_every", "checkpoint.", "profile",
         "output_dir", "data.num_workers", "data.max_bad_fraction", "model.path", "model.recompute")
_FIXED = ("model.", "data.", "train.seed", "train.global_batch_size", "train.global_batch_tokens", "train.objective",
          "dpo.", "grpo.")
PACKAGES = ("mm-train", "mm-parallel", "mm-models-vl", "mm-models-video", "mm-data", "mm-profiling", "mindspore",
            "numpy", "safetensors", "transformers")


def other_run(out: str) -> List[str]:
    """What in ``out`` belongs to a run: checkpoint folders and a non-empty metrics.jsonl."""
    found = []
    root = os.path.join(out, "checkpoints")
    if os.path.isdir(root):
        found += sorted(name for name in os.listdir(root) if name.startswith(("step_", ".step_")))
    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        found.append("metrics.jsonl")
    return found


def check_unclaimed(out: str, resume: bool, overwrite: bool) -> None:
    """Refuse a new run in another run's output_dir (see the module docstring)."""
    if resume or overwrite:
        return
    found = other_run(out)
    if found:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise ValueError(f"output_dir {out} holds another run ({shown}); continue it with --resume, train into "
                         f"another folder with --set output_dir=..., or replace it with --overwrite")


def clear(out: str) -> List[str]:
    """Remove a previous run's outputs from ``out`` (``--overwrite``); logs and feature caches
    stay. Returns what was removed."""
    removed = []
    for name in RUN_OUTPUTS:
        path = os.path.join(out, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
        else:
            continue
        removed.append(name)
    return removed


def versions() -> Dict[str, str]:
    """The installed versions of the packages a run depends on (saved with each checkpoint)."""
    found = {}
    for name in PACKAGES:
        try:  # ours from the source (an editable install's metadata keeps the version it was installed at)
            found[name] = (importlib.import_module(name.replace("-", "_") + ".__about__").__version__
                           if name.startswith("mm-") else metadata.version(name))
        except (ImportError, metadata.PackageNotFoundError):
            continue
    return found


def _flat(d: dict, prefix: str = "") -> Dict[str, object]:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def resume_changes(saved: Optional[dict], current: dict) -> Tuple[List[str], List[str]]:
    """(refused, noted): "field: saved -> current" for each recipe field that differs between the
    checkpoint's recipe and this run's (both as JSON has them), split by the rules of the module
    docstring."""
    if saved is None:  # a checkpoint from before recipes were saved with it
        return [], []
    old, new = (_flat(json.loads(json.dumps(recipe, default=str))) for recipe in (saved, current))  # as JSON has them
    refused, noted = [], []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a == b or key.startswith(_FREE):
            continue
        (refused if key.startswith(_FIXED) else noted).append(f"{key}: {a!r} -> {b!r}")
    return refused, noted


@dataclass
class RunStart:
    """What `start` settled: the checkpoint to resume (None: step 0) and what every checkpoint of
    this run records (trainer_state.json's run_id, versions, data_fingerprint; recipe.json)."""

    resume_from: Optional[str]
    record: dict


def start(recipe, task, topo, resume: bool = False, resume_from: Optional[str] = None,
          overwrite: bool = False, disks=None) -> RunStart:
    """Before training (every rank calls): claim output_dir, tidy interrupted saves, choose the
    checkpoint to resume (``resume_from``, else the newest that verifies when ``resume``) and
    refuse one whose model, data order or data set differ from this run's. Rank 0 decides and
    reads the disk; the others follow its decision (`_from_rank_zero`), so they never disagree. On
    node-local disks (``disks``, `mm_train.node_disks`) each node's first rank tidies its own
    disk and the choice checks every node's part of a checkpoint (collectives of every rank)."""
    out, step, record, problem = recipe.output_dir, _REFUSED, {}, None
    disks = disks or node_disks.shared(topo)
    try:
        if disks.folder_writer:
            _tidy(out, resume or bool(resume_from), overwrite, claim=topo.rank == 0)
    except ValueError as error:
        problem = error
    if disks.shared:
        chosen = _choose(out, resume, resume_from, checkpoint.verify, checkpoint.find_latest) \
            if topo.rank == 0 else None
    else:  # every rank takes part: the verdicts are gathered from each node
        chosen = _choose(out, resume, resume_from, lambda folder: checkpoint.verify_on_nodes(folder, disks, topo),
                         lambda out: checkpoint.find_latest_on_nodes(out, disks, topo))
    if topo.rank == 0:
        try:
            if problem is not None:
                raise problem
            step, record = _decide(recipe, task, resume, chosen)
        except (ValueError, FileNotFoundError) as error:
            problem = error
    step, record = _from_rank_zero(topo, [step, record])
    if step == _REFUSED:
        if topo.rank == 0:
            raise problem
        time.sleep(2.0)  # rank 0 stops first, so its reason is the account the launcher shows
        raise ValueError("rank 0 refused to start the run (its log says why)")
    folder = None if step < 0 else resume_from or os.path.join(out, "checkpoints", f"step_{step}")
    return RunStart(folder, record)


_REFUSED = -2


def _tidy(out: str, resuming: bool, overwrite: bool, claim: bool) -> None:
    """Claim output_dir (``claim``: rank 0), clear it under --overwrite, tidy interrupted saves."""
    if claim:
        check_unclaimed(out, resuming, overwrite)
    if overwrite and not resuming:
        for name in clear(out):
            _say(f"--overwrite removed {os.path.join(out, name)}")
    for line in checkpoint.recover(out):
        _say(line)


def _choose(out: str, resume: bool, resume_from: Optional[str], verify, find_latest):
    """(the checkpoint folder to resume or None, [(skipped folder, reason)], or why
    ``resume_from`` cannot be used) — `verify` / `find_latest` of one disk or of every node's."""
    if resume_from:
        reason = verify(resume_from)
        if reason:
            return None, [], f"--resume-from {resume_from} cannot be used: {reason}"
        return resume_from, [], None
    if resume:
        folder, skipped = find_latest(out)
        return folder, skipped, None
    return None, [], None


def _decide(recipe, task, resume, chosen) -> Tuple[int, dict]:
    """Rank 0's part of `start`: (the step to resume, -1 for none; the run's record)."""
    out = recipe.output_dir
    folder, skipped, refusal = chosen
    if refusal:
        raise ValueError(refusal)
    for bad, reason in skipped:
        _say(f"skipping checkpoint {bad}: {reason}")
    fingerprint = data_fingerprint.fingerprint(*task.data_files())
    record = {"run_id": uuid.uuid4().hex, "versions": versions(), "data_fingerprint": fingerprint,
              "recipe": recipe.to_dict()}
    if folder is None:
        if resume:
            _say(f"--resume found no complete checkpoint in {out}; starting at step 0")
        return -1, record
    state = checkpoint.trainer_state(folder)
    refused, noted = resume_changes(_as_typed(checkpoint.saved_recipe(folder)), record["recipe"])
    if refused:
        raise ValueError(f"{folder} was trained with another model or data order: " + "; ".join(refused) +
                         ". Resume with the recipe it was written with (its recipe.json), or start a new run")
    changed = data_fingerprint.differences(state.get("data_fingerprint"), fingerprint)
    if changed:
        raise ValueError(f"the data set changed since {folder} was written, so its data position would name other "
                         "samples: " + "; ".join(changed) + ". Restore the data set, or start a new run on the new "
                         "one (another output_dir, or --overwrite)")
    for line in noted:
        _say(f"resuming with a changed setting: {line}")
    record["run_id"] = state.get("run_id", record["run_id"])  # the run goes on under its own id
    _say(f"resuming from {folder} (step {state['step']})")
    return int(state["step"]), record


def _as_typed(saved: Optional[dict]) -> Optional[dict]:
    """A checkpoint's recipe.json as this version's typed recipe writes it, so that a section an
    older version recorded as given (model.lora {r: 4}) compares with its defaults filled in; as
    recorded when this version cannot read it (the comparison then names what differs)."""
    if saved is None:
        return None

    try:
        return build_recipe(saved).to_dict()
    except (ValueError, TypeError, KeyError, ImportError):
        return saved


def _from_rank_zero(topo, value):
    """Rank 0's ``value`` (JSON) on every rank, rank 0 included, so that every copy of what it
    records (node-local disks: each node's trainer_state / recipe.json) is written from the same
    bytes."""
    from mm_parallel import comm

    mine = json.dumps(value, default=str).encode() if topo.rank == 0 else b""
    return json.loads(comm.all_gather_bytes(mine, topo.world)[0])


def _say(line: str) -> None:
    print(f"mm-train: {line}", file=sys.stderr, flush=True)
