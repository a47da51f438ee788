"""Where this node sits in a multi-node job, read from the scheduler that started it.

`mm-train launch` takes ``--nnodes``, ``--node-rank``, ``--master-addr`` and ``--master-port``;
what the command line leaves out comes from the job's environment (`node_place`):

    Slurm        SLURM_JOB_ID set: nodes SLURM_NNODES (or SLURM_JOB_NUM_NODES), rank SLURM_NODEID,
                 master the first host of SLURM_JOB_NODELIST as Slurm writes it ("node[01-03,7]",
                 several groups, "rack[1-2]-n[1-2]"), port MASTER_PORT or 20000 + the job id mod
                 20000 (every node of the job derives the same one)
    Kubernetes   MASTER_ADDR and MASTER_PORT set (Kubeflow's PyTorchJob, a Volcano job with its
                 torch plugin): the pod's index VC_TASK_INDEX or RANK, nodes WORLD_SIZE counting
                 pods (one launcher per pod)

Workers per node: ``--nproc-per-node``, else the recipe's cluster.devices_per_node when above 1,
else SLURM_NTASKS_PER_NODE when above 1 ("8(x2)" read as 8), else the devices the job made
visible (ASCEND_RT_VISIBLE_DEVICES / ASCEND_VISIBLE_DEVICES), else 1. `describe` says which source
gave each value, printed once by the launcher.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Mapping

FIELDS = ("nnodes", "node_rank", "master_addr", "master_port", "nproc_per_node")


def expand_hostlist(text: str) -> List[str]:
    """Slurm's compressed host list, expanded in order: "n[01-02,5],gpu" -> n01, n02, n5, gpu."""
    hosts: List[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", text):
        names = [""]
        for literal, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            names = [n + literal for n in names]
            if ranges:
                names = [n + number for n in names for number in _numbers(ranges, text)]
        hosts += [n for n in names if n]
    if not hosts:
        raise ValueError(f"the Slurm host list {text!r} names no host")
    return hosts


def _numbers(ranges: str, text: str) -> List[str]:
    out = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"cannot read the Slurm host list {text!r}: {part!r} is not a number or a range")
        out += [str(n).zfill(len(low)) for n in range(int(low), int(high or low) + 1)]
    return out


def _leading_int(value: str) -> int:
    match = re.match(r"\s*(\d+)", value or "")
    return int(match.group(1)) if match else 0


@dataclass
class NodePlace:
    """The launch's node values and, for each, where it came from."""

    values: Dict[str, object] = field(default_factory=dict)
    sources: Dict[str, str] = field(default_factory=dict)

    def take(self, name: str, value, source: str) -> None:
        if self.values.get(name) is None and value is not None:
            self.values[name], self.sources[name] = value, source

    def describe(self) -> str:
        by_source: Dict[str, List[str]] = {}
        for name in FIELDS:
            if name in self.sources:
                by_source.setdefault(self.sources[name], []).append(f"{name.replace('_', '-')} {self.values[name]}")
        return "; ".join(f"{', '.join(items)} from {source}" for source, items in by_source.items())


def _from_slurm(place: NodePlace, env: Mapping[str, str]) -> None:
    nodes = env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    place.take("nnodes", int(nodes) if nodes else None, "Slurm")
    place.take("node_rank", int(env["SLURM_NODEID"]) if env.get("SLURM_NODEID") else None, "Slurm")
    place.take("master_addr", expand_hostlist(nodelist)[0] if nodelist else None, "Slurm")
    if env.get("MASTER_PORT"):
        place.take("master_port", int(env["MASTER_PORT"]), "MASTER_PORT")
    place.take("master_port", 20000 + int(env["SLURM_JOB_ID"]) % 20000, "Slurm (from the job id)")
    tasks = _leading_int(env.get("SLURM_NTASKS_PER_NODE", ""))
    place.take("nproc_per_node", tasks if tasks > 1 else None, "Slurm (SLURM_NTASKS_PER_NODE)")


def _from_kubernetes(place: NodePlace, env: Mapping[str, str]) -> None:
    index = env.get("VC_TASK_INDEX") or env.get("RANK")
    place.take("master_addr", env["MASTER_ADDR"], "the job's MASTER_ADDR")
    place.take("master_port", int(env["MASTER_PORT"]), "the job's MASTER_PORT")
    place.take("node_rank", int(index) if index else None,
               "the pod's VC_TASK_INDEX" if env.get("VC_TASK_INDEX") else "the pod's RANK")
    place.take("nnodes", int(env["WORLD_SIZE"]) if env.get("WORLD_SIZE") else None, "the job's WORLD_SIZE (pods)")


def node_place(given: Mapping[str, object], env: Mapping[str, str], recipe_devices_per_node: int = 1) -> NodePlace:
    """The node values: ``given`` (the command line; None where absent) first, then the
    scheduler's environment, then the recipe and the visible devices (module docstring). Raises
    ValueError naming what is still missing."""
    place = NodePlace()
    for name in FIELDS:
        place.take(name, given.get(name), "the command line")
    if env.get("SLURM_JOB_ID"):
        _from_slurm(place, env)
    elif env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        _from_kubernetes(place, env)
    place.take("nproc_per_node", recipe_devices_per_node if recipe_devices_per_node > 1 else None,
               "the recipe's cluster.devices_per_node")
    visible = env.get("ASCEND_RT_VISIBLE_DEVICES") or env.get("ASCEND_VISIBLE_DEVICES")
    place.take("nproc_per_node", len([d for d in visible.split(",") if d.strip()]) if visible else None,
               "the visible devices")
    place.take("nproc_per_node", 1, "the default")
    missing = [name for name in FIELDS if place.values.get(name) is None]
    if missing:
        flags = ", ".join("--" + name.replace("_", "-") for name in missing)
        raise ValueError(f"mm-train launch needs {flags}: pass them, or start it from a Slurm job (SLURM_JOB_ID, "
                         "SLURM_NNODES, SLURM_NODEID, SLURM_JOB_NODELIST) or a Kubernetes / Volcano job "
                         "(MASTER_ADDR, MASTER_PORT, VC_TASK_INDEX or RANK, WORLD_SIZE)")
    if not 0 <= place.values["node_rank"] < place.values["nnodes"]:
        raise ValueError(f"node rank {place.values['node_rank']} ({place.sources['node_rank']}) is not in 0 .. "
                         f"{place.values['nnodes'] - 1} ({place.sources['nnodes']})")
    return place
