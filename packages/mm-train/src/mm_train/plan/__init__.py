"""`mm-train plan`: memory per device, step time, SPS / TPS and MFU of a recipe on a cluster,
predicted from the recipe and the model's config.json alone (no weights read).

The cluster is the recipe's ``cluster`` section (nodes, devices_per_node, device), which flags
override; devices come from devices.yaml beside this module (plus a user file). Memory is counted
by `mm_train.plan.memory` (parameters from the model code built by shape only), time by
`mm_train.plan.timing`, the shapes by the family's ``workload`` (`mm_train.plan.workload`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Dict, Optional

import yaml

from mm_train import preflight
from mm_train.plan import memory, timing
from mm_train.plan.batches import reference_passes, sequences_per_sample, step_batches

# Deferred imports: MindSpore and mm-parallel (the CLI starts without loading MindSpore).

DEVICES_FILE = Path(__file__).with_name("devices.yaml")
HEADROOM = 0.9  # a plan fits when its peak is at most this share of the device memory it may use


def load_devices(extra: Optional[str] = None) -> dict:
    """{"devices": {...}, "efficiency": {...}} from devices.yaml, updated by ``extra`` or $MM_TRAIN_DEVICES."""
    with open(DEVICES_FILE) as f:
        known = yaml.safe_load(f)
    extra = extra or os.environ.get("MM_TRAIN_DEVICES")
    if extra:
        with open(extra) as f:
            more = yaml.safe_load(f) or {}
        known["devices"].update(more.get("devices", {}))
        known["efficiency"].update(more.get("efficiency", {}))
        known.setdefault("calibrated", {}).update(more.get("calibrated", {}))
    return known


def host_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))


def efficiency_of(known: dict, device: str) -> dict:
    """The efficiencies a plan on ``device`` uses: its calibration's (devices.yaml ``calibrated``,
    fitted per device and framework by benchmarks/plan_calibration.py on calibration.yaml's
    figures) over the shared ``efficiency``."""
    calibration = known["devices"][device].get("calibration")
    return {**known["efficiency"], **(known.get("calibrated", {}).get(calibration) or {})}


def device_spec(name: str, known: dict) -> dict:
    if name not in known["devices"]:
        raise ValueError(f"device {name!r} is unknown; choose one of {sorted(known['devices'])} or add it to a "
                         "devices file (--devices FILE)")
    device = dict(known["devices"][name], name=name)
    device["memory_bytes"] = int(device["memory_gib"] * 2 ** 30) if device["memory_gib"] else host_memory_bytes()
    return device


def model_config(recipe, complete: bool = True):
    """(config.json mapping, the config as the model class loads it): model.path's config.json
    (with model.config overrides), else the inline config — completed by the family's task
    (tokenizer vocabulary and special tokens; the task reads its data) or, ``complete=False``,
    as written (the model's defaults for what it leaves out)."""
    from mm_parallel import ParallelConfig
    from mm_parallel.topology import Topology

    spec = recipe.family
    raw = preflight.model_config(recipe)
    if recipe.model.path:
        return raw, spec.model_class(raw).load_config(raw, recipe.model.config_overrides)  # read once: ModelSource
    if not complete:
        return raw, spec.model_class(raw).load_config(raw)
    task = spec.task(recipe, Topology.build(ParallelConfig(), 1, 0))
    return task.model_json, spec.model_class(task.model_json).load_config(task.inline_config())


def cluster_of(recipe, nodes: Optional[int] = None, devices_per_node: Optional[int] = None,
               device: Optional[str] = None) -> Dict:
    """{nodes, devices_per_node, device}: the recipe's cluster section, the arguments given overriding it."""
    return {"nodes": nodes or recipe.cluster.nodes,
            "devices_per_node": devices_per_node or recipe.cluster.devices_per_node,
            "device": device or recipe.cluster.device}


def make_plan(recipe, nodes: Optional[int] = None, devices_per_node: Optional[int] = None,
              device: Optional[str] = None, devices_file: Optional[str] = None, complete_config: bool = True) -> Dict:
    """The plan of ``recipe`` on its cluster (the arguments override the recipe's cluster section;
    ``complete_config``: see `model_config`)."""
    cluster = cluster_of(recipe, nodes, devices_per_node, device)
    return plan_on(recipe, cluster, load_devices(devices_file), model_config(recipe, complete_config))


def plan_on(recipe, cluster: Dict, known: Dict, configs, built: Optional[Dict] = None,
            framework: str = "mm") -> Dict:
    """The plan of ``recipe`` on ``cluster`` ({nodes, devices_per_node, device}) given the model's
    ``configs`` (`model_config`); ``built``: a cache of shape-only chunks by model-parallel
    position, shared by plans that differ only in what leaves the parameters alone (`search`);
    ``framework``: whose pipeline runs it (mm's, or another's for the calibration: plan.timing)."""
    from mm_parallel.topology import Topology

    spec_device = device_spec(cluster["device"], known)
    world = cluster["nodes"] * cluster["devices_per_node"]
    raw, config = configs
    family = recipe.family
    if not family.workload:
        raise ValueError(f"family {family.name} gives no workload: mm-train plan cannot predict it")
    workload = family.workload(recipe, config)
    step = step_batches(recipe, workload, world)
    micro_batches, modelled = step.micro_batches, step.recipe  # packed: rows taken as samples (plan.batches)
    built = {} if built is None else built
    par = recipe.parallel
    if par.ranks_per_node is None:  # hybrid ZeRO-3 shards over the cluster's nodes
        par = dataclasses.replace(par, ranks_per_node=cluster["devices_per_node"])
    efficiency = efficiency_of(known, spec_device["name"])
    ranks, peak, slowest = [], 0, None
    for position in memory.positions(par, world):
        topo = Topology.build(par, world, position.rank)
        key = (par.tp, par.pp, par.vpp, par.pp_layers, par.ep, par.expert_tp, position.tp, position.pp, position.ep)
        if key not in built:
            built[key] = memory.build_chunks(family, recipe, raw, config, topo)
        entry = {"tp_rank": position.tp, "pp_stage": position.pp, "ep_rank": position.ep, "count": position.count,
                 **memory.static_bytes(built[key], recipe, topo),
                 **memory.activation_bytes(step.workload, modelled, topo, spec_device, micro_batches)}
        # dpo.reference copy: a frozen second model, sharded like the policy (its weights' bytes)
        entry["reference_bytes"] = entry["weights_bytes"] if _reference_copy(recipe) else 0
        entry["weights_bytes"] += entry["reference_bytes"]
        # the step's buffers come after the backward has freed the activations: the larger counts
        # (a ZeRO-3 layer's gathered weight lives while it runs, beside the activations)
        # grpo: the rollouts' key/value cache lives while generating, when the training activations do not
        entry["kv_cache_bytes"] = _kv_cache_bytes(recipe, workload, topo, step.samples)
        entry["total_bytes"] = sum(entry[k] for k in ("weights_bytes", "grads_bytes", "optimizer_bytes")) + max(
            entry["activations_bytes"] + entry["zero3_gather_bytes"], entry["optimizer_step_buffers_bytes"],
            entry["kv_cache_bytes"])
        times = timing.step_time(step.workload, modelled, topo, spec_device, cluster, efficiency,
                                 entry["reduced_numel"], micro_batches, entry["zero3_numel"],
                                 entry["optimizer_host_bytes"], framework)
        if recipe.train.objective == "grpo":  # the rollouts' share of a step (plan.timing)
            times["generate_s"] = timing.generation_time(recipe, workload, topo, spec_device, efficiency,
                                                         step.samples)
            times["step_time_s"] += times["generate_s"]
            times["terms"].append(("generation", times["generate_s"], "the rollouts' prefill and one-token steps"))
        ranks.append(entry)
        peak = max(peak, entry["total_bytes"])
        slowest = times if slowest is None or times["step_time_s"] > slowest["step_time_s"] else slowest
    plan = _summary(recipe, cluster, spec_device, world, ranks, peak, slowest, workload, step.samples)
    passes = timing.Passes.of(modelled, step.workload, par.pp, framework)
    plan["assumptions"] = {"framework": framework, "efficiency": efficiency, "micro_batches": micro_batches,
                           "calibration": known["devices"][spec_device["name"]].get("calibration"),
                           "passes": dataclasses.asdict(passes)}
    return plan


def _kv_cache_bytes(recipe, workload, topo, prompts: int) -> int:
    """train.objective grpo: the key/value cache of the rank's rollouts (its prompts x
    num_generations rows of data.max_length tokens, keys and values of its stage's layers, the kv
    heads split over tp, in the run's dtype); 0 for the other objectives."""
    if recipe.train.objective != "grpo":
        return 0
    causal = [a for a in workload.attention if a.causal]
    if not causal:
        return 0
    form, stack = causal[-1], workload.pipelined
    rows = prompts / topo.dp.size * recipe.grpo.num_generations
    size = 2 if recipe.train.precision in ("bf16", "fp16") else 4
    layers = memory.stage_layers(stack.layers, topo)
    return int(rows * workload.tokens_per_sample * layers * 2 * form.kv_heads * form.head_dim / topo.tp.size * size)


def _reference_copy(recipe) -> bool:
    """A frozen second copy of the weights: dpo.reference copy, or grpo's with beta > 0."""
    objective = recipe.train.objective
    if objective == "grpo":
        return bool(recipe.grpo.beta) and recipe.grpo.reference == "copy"
    return objective == "dpo" and recipe.dpo.reference == "copy"


def machine_device(recipe) -> str:
    """The device this machine trains on, as devices.yaml names it: the recipe's cluster.device
    where MindSpore targets Ascend (which 910B it is, the recipe says), else the host ("cpu")."""
    import mindspore as ms

    return recipe.cluster.device if ms.get_context("device_target") == "Ascend" else "cpu"


def refuse_unfitting(recipe, nodes: int, devices_per_node: int, force: bool = False) -> Optional[Dict]:
    """Before a run starts: its plan on the machines it is started on (``nodes`` x
    ``devices_per_node`` of `machine_device`); ValueError when the plan does not fit, unless
    ``force``. An inline config is planned as written (its task, which reads the data, is not
    built here), a family without a workload is not checked (said on stderr)."""
    if force:
        return None
    if not recipe.family.workload:
        print(f"mm-train: family {recipe.family.name} gives no workload: its memory is not checked before launch",
              file=sys.stderr)
        return None
    device = machine_device(recipe)
    plan = make_plan(recipe, nodes, devices_per_node, device, complete_config=False)
    gib = 2 ** 30
    if not plan["host_fits"]:
        raise ValueError(
            f"optim.offload=optimizer keeps {plan['host_bytes_per_node'] / gib:.1f} GiB of optimizer state in each "
            f"node's host memory, more than the {device} servers' host_memory_gib allows (devices.yaml): raise "
            "parallel.zero_stage / dp, add nodes, or leave optim.offload unset (--force runs anyway)")
    if not plan["fits"]:
        need = plan["demand_bytes"] / gib
        where = "for all its processes on this host" if plan["demand_bytes"] != plan["peak_bytes"] else "per device"
        raise ValueError(
            f"the plan needs {need:.1f} GiB {where} on {nodes} x {devices_per_node} {device}, more than the "
            f"{plan['usable_bytes'] / gib:.1f} GiB it may use: raise parallel.tp / pp / zero_stage, set "
            f"model.recompute, or add devices (`mm-train plan` shows where the memory goes; --force runs anyway)")
    return plan


def _summary(recipe, cluster, device, world, ranks, peak, times, workload, samples: int) -> Dict:
    shared = device.get("shared_memory", False)  # one host's RAM holds every process
    usable = device["memory_bytes"] * device["usable_fraction"] * HEADROOM
    host = max(r["optimizer_host_bytes"] for r in ranks) * cluster["devices_per_node"]  # optim.offload, a node's
    demand = sum((r["total_bytes"] + r["optimizer_host_bytes"]) * r["count"] for r in ranks) if shared else peak
    host_gib = device.get("host_memory_gib")  # unknown: not checked; a shared host's RAM is in the demand
    host_usable = float("inf") if shared or host_gib is None else host_gib * 2 ** 30 * device["usable_fraction"]
    step = times["step_time_s"]
    sps = samples / step if step else 0.0
    # model FLOPs: no recompute, frozen towers forward only; dpo: each pair's sequences, the reference's forward too
    model_passes = timing.forward_and_backward(recipe)
    flops = sequences_per_sample(recipe) * (timing.step_flops(workload, model_passes) + reference_passes(recipe) *
                                            timing.step_flops(workload, 1)) * sps
    terms = {k[:-2]: v for k, v in times.items() if k not in ("step_time_s", "terms")}
    tokens = sps * workload.tokens_per_sample * sequences_per_sample(recipe)
    notes = list(workload.notes)
    if recipe.train.objective == "dpo":
        notes.append(f"dpo: a sample is a pair of two sequences, each also run forward by the frozen reference "
                     f"({'a second copy of the weights' if _reference_copy(recipe) else 'the adapters switched off'})")
    if recipe.train.objective == "grpo":
        grpo = recipe.grpo
        reference = "no reference (beta 0)" if not grpo.beta else \
            f"the reference forward ({'a second copy of the weights' if _reference_copy(recipe) else 'adapters off'})"
        notes.append(f"grpo: a sample is a prompt, {grpo.num_generations} sampled completions of up to "
                     f"{grpo.max_completion_length} tokens trained; generation counted every {grpo.num_iterations} "
                     f"step(s) (prefill and one-token steps, launch-bound), {reference}")
    row = workload.packed
    if row is not None:
        notes.append(f"packed rows of {row.samples} samples ({row.tokens} tokens of the {row.budget}-token budget, "
                     f"{row.positions} positions: {row.padding_fraction:.1%} padding assumed), attention per sample")
    packing = {"samples_per_row": row.samples, "row_tokens": row.tokens, "row_positions": row.positions,
               "padding_fraction": row.padding_fraction} if row is not None else None
    return {"packing": packing, "batch_samples": samples,
            "fits": demand <= usable and host <= host_usable, "host_fits": host <= host_usable,
            "host_bytes_per_node": int(host), "devices": world, "cluster": cluster, "device": device["name"],
            "device_memory_bytes": device["memory_bytes"], "usable_bytes": int(usable), "ranks": ranks,
            "peak_bytes": int(peak), "demand_bytes": int(demand), "step_time_s": step,
            # the cluster's throughput, and one device's (MindSpeed-MM publishes SPS per cluster, TPS per device)
            "samples_per_s": sps, "tokens_per_s": tokens, "samples_per_s_per_device": sps / world,
            "tokens_per_s_per_device": tokens / world, "terms": times["terms"],
            "mfu": flops / (world * device["peak_tflops"] * 1e12) if device["peak_tflops"] else 0.0,
            "breakdown": terms, "dominant": max(terms, key=terms.get), "notes": notes}


def render(plan: Dict) -> str:
    """The human table of a plan."""
    gib = 2 ** 30
    lines = [f"{plan['devices']} x {plan['device']} ({plan['cluster']['nodes']} x {plan['cluster']['devices_per_node']}"
             f"), {plan['device_memory_bytes'] / gib:.1f} GiB each, plan for <= {plan['usable_bytes'] / gib:.1f} GiB",
             f"{'tp':>3} {'pp':>3} {'ep':>3} {'ranks':>5} {'params':>12} {'weights':>9} {'grads':>9} {'optim':>9} "
             f"{'activ.':>9} {'total GiB':>9}"]
    for r in plan["ranks"]:
        lines.append(f"{r['tp_rank']:>3} {r['pp_stage']:>3} {r['ep_rank']:>3} {r['count']:>5} {r['params']:>12,} "
                     + " ".join(f"{r[k] / gib:>9.2f}" for k in ("weights_bytes", "grads_bytes", "optimizer_bytes",
                                                               "activations_bytes", "total_bytes")))
    verdict = "fits" if plan["fits"] else "DOES NOT FIT"
    lines.append(f"peak {plan['peak_bytes'] / gib:.2f} GiB per rank: {verdict}")
    parts = ", ".join(f"{k} {v:.3g} s" for k, v in plan["breakdown"].items() if v)
    lines.append(f"step {plan['step_time_s']:.3g} s ({parts}; {plan['dominant']} dominates): "
                 f"{plan['samples_per_s']:.3g} samples/s and {plan['tokens_per_s']:.4g} tokens/s on the cluster, "
                 f"{plan['tokens_per_s_per_device']:.4g} tokens/s per device, MFU {plan['mfu']:.1%}")
    lines += [f"note: {n}" for n in plan["notes"]]
    return "\n".join(lines)
