"""Training checkpoints: OUT/checkpoints/step_N/, layout-independent, written atomically.

    step_N/model/              the model in its Hugging Face form (save_pretrained; tp gathered)
    step_N/adapters/           PEFT adapters, when the run trains LoRA
    step_N/optimizer-stageK.safetensors   per trainable parameter of pipeline stage K (by its name
                               in the whole model): <name>.master, .exp_avg, .exp_avg_sq, full tensors,
                               and the step counters (DistributedOptimizer.save: its one format)
    step_N/trainer_state.json  step, the data position (epoch, batch), the layout
                               that wrote it (parameter names: the whole model's, ``model.adapter_name``)

Everything is stored whole (tp shards and ZeRO slices gathered, stages by global names), so a run
resumes under any layout (TP2 -> TP1, PP2 -> PP1, DP2 -> DP1 ...): each rank cuts its shard again while loading. A
checkpoint
is written into a temporary folder, every file fsynced, and renamed to step_N only when complete:
a step_N folder is always whole, and a crash mid-write leaves only a ``.tmp`` folder that resume
ignores (and the next save removes). The newest ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Optional

_STEP = re.compile(r"^step_(\d+)$")


def _fsync_tree(folder: str) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def latest(out: str) -> Optional[str]:
    """The newest complete checkpoint folder under OUT/checkpoints, or None."""
    root = os.path.join(out, "checkpoints")
    if not os.path.isdir(root):
        return None
    steps = [(int(m.group(1)), name) for name in os.listdir(root) if (m := _STEP.match(name))
             and os.path.exists(os.path.join(root, name, "trainer_state.json"))]
    return os.path.join(root, max(steps)[1]) if steps else None


def _names(chunks, optimizer):
    """Each optimizer parameter's name in the whole model (pipeline stages numbered as one)."""
    from mm_parallel.hf_checkpoint import owned_parameters

    names = {id(p): chunk.adapter_name(chunk, name) for chunk in chunks for name, p, _, _ in owned_parameters(chunk)}
    return [names[id(p)] for p in optimizer.params]


def save(out: str, step: int, chunks, optimizer, topo, lora=None, keep: int = 2,
         data_state: Optional[dict] = None, model_dtype: Optional[str] = None) -> Optional[str]:
    """Write step_N (every rank calls: the gathers are collectives); returns its path.
    ``chunks``: the model chunks (virtual pipeline stages) this rank holds, usually one;
    ``model_dtype``: the model weights' dtype on disk (default the parameters'; the optimizer
    state is fp32 whatever it is)."""
    from mm_parallel import comm

    root = os.path.join(out, "checkpoints")
    final, tmp = os.path.join(root, f"step_{step}"), os.path.join(root, f".step_{step}.tmp")
    if topo.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    if topo.world_size > 1:
        comm.barrier(topo.world)
    chunks[0].save_pretrained(os.path.join(tmp, "model"), chunks, dtype=model_dtype)
    if lora is not None:
        chunks[0].save_adapter(os.path.join(tmp, "adapters"), lora, chunks)
    optimizer.save(tmp, _names(chunks, optimizer))  # one file per pipeline stage; waits for every stage
    if topo.rank == 0:
        state = {"step": step, "data": data_state,
                 "layout": {"world_size": topo.world_size, "tp": topo.tp.size, "pp": topo.pp.size, "dp": topo.dp.size}}
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(state, f, indent=2)
        _fsync_tree(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _prune(root, keep)
    if topo.world_size > 1:
        comm.barrier(topo.world)
    return final


def _prune(root: str, keep: int) -> None:
    steps = sorted((int(m.group(1)), name) for name in os.listdir(root) if (m := _STEP.match(name)))
    for _, name in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    for name in os.listdir(root):  # leftovers of interrupted saves
        if name.endswith(".tmp"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def load_optimizer(folder: str, chunks, optimizer) -> int:
    """Set the optimizer (and through its master weights the parameters) from step_N; returns
    the step to continue from."""
    optimizer.load(folder, _names(chunks, optimizer))
    with open(os.path.join(folder, "trainer_state.json")) as f:
        return int(json.load(f)["step"])
