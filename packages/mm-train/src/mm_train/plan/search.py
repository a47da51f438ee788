"""`mm-train plan --search`: every layout of a recipe's cluster that fits, ranked by predicted
throughput.

A layout is (tp, pp, vpp, cp, ep, ZeRO stage, optimizer offload with ZeRO-3, recompute,
micro-batch size); everything else of
the recipe (precision, LoRA, freezing, the batch, the data) stays. `candidates` lists the layouts
the world and the batch can hold: tp within a server (its collectives run every layer), sequence
parallelism whenever tp > 1 (it only divides activations), cp with the recipe's algorithm, ep for
a MoE model only, vpp up to 4 when the micro-batches allow it. Each is planned as `make_plan`
plans it; a layout the model cannot be cut into (heads, layers, experts: the family's preflight,
as `mm-train run` checks it, or the model code while building) is dropped and counted.
Shape-only chunks are built once per model-parallel position and shared by the layouts that
differ only in cp / ZeRO / recompute / micro-batch: 684 layouts of Qwen2.5-VL-7B on 1 x 8 take
about 19 s here.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, List, Optional

from mm_train.plan import cluster_of, load_devices, model_config, plan_on

RECOMPUTE_MODES = ("none", "selective", "full")
MICRO_BATCH_SIZES = (1, 2, 4)
ZERO_STAGES = (0, 1, 2, 3)
SINGLE = {"parallel": dict(tp=1, pp=1, vpp=1, cp=1, ep=1, zero_stage=0, sequence_parallel=False),
          "recompute": "none", "micro_batch_size": 1}


def _divisors(n: int, limit: int) -> List[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def candidates(world: int, devices_per_node: int, global_batch: int, moe: bool) -> Iterator[Dict]:
    """Every layout {parallel: {...}, recompute, micro_batch_size} ``world`` devices and a global
    batch of ``global_batch`` samples can hold (the model's own divisibility is not checked here)."""
    for tp in _divisors(world, devices_per_node):
        for pp in _divisors(world // tp, world):
            for cp in _divisors(world // (tp * pp), 16):
                dp = world // (tp * pp * cp)
                for ep in (_divisors(dp * cp, 64) if moe else [1]):
                    for mbs in MICRO_BATCH_SIZES:
                        if global_batch % (mbs * dp):
                            continue
                        micro_batches = global_batch // (mbs * dp)
                        for vpp in [v for v in (1, 2, 4) if v == 1 or (pp > 1 and micro_batches % pp == 0)]:
                            # ZeRO shards over dp: with dp = 1 every stage is the same layout
                            for zero in (ZERO_STAGES if dp > 1 else (0,)):
                                # the optimizer state in host memory: tried with ZeRO-3, whose
                                # device bytes it then leaves to the weights and activations
                                for offload in ((None, "optimizer") if zero == 3 else (None,)):
                                    for recompute in RECOMPUTE_MODES:
                                        yield {"parallel": dict(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, zero_stage=zero,
                                                                sequence_parallel=tp > 1),
                                               "recompute": recompute, "micro_batch_size": mbs, "offload": offload}


def with_layout(recipe, layout: Dict):
    """``recipe`` under ``layout`` (a `candidates` entry)."""
    # a recipe's uneven split belongs to its own pp x vpp: the searched layouts split evenly
    parallel = dataclasses.replace(recipe.parallel, pp_layers=None, **layout["parallel"])
    model = dataclasses.replace(recipe.model, recompute=layout["recompute"], recompute_num_layers=None)
    train = dataclasses.replace(recipe.train, micro_batch_size=layout["micro_batch_size"])
    optim = dataclasses.replace(recipe.optim, offload=layout.get("offload"))
    return dataclasses.replace(recipe, parallel=parallel, model=model, train=train, optim=optim)


def search(recipe, nodes: Optional[int] = None, devices_per_node: Optional[int] = None, device: Optional[str] = None,
           devices_file: Optional[str] = None) -> Dict:
    """{cluster, layouts: the fitting ones, fastest first, each {layout, peak_bytes, step_time_s,
    samples_per_s, tokens_per_s, mfu, dominant}, tried, fitting, refused: {reason: count}}."""
    cluster = cluster_of(recipe, nodes, devices_per_node, device)
    known = load_devices(devices_file)
    configs = model_config(recipe)
    moe = _is_moe(configs[1])
    world = cluster["nodes"] * cluster["devices_per_node"]
    rules = recipe.family.preflight
    # what the preflight finds under no parallelism at all (missing data files) is not the layout's
    baseline = set(rules(with_layout(recipe, SINGLE), configs[0])) if rules else set()
    built: Dict = {}
    found, refused, tried = [], {}, 0
    # a token budget's batch (packed rows, whose number is free) holds any layout: a batch every one divides
    batch = recipe.train.global_batch_size or world * max(MICRO_BATCH_SIZES)
    for layout in candidates(world, cluster["devices_per_node"], batch, moe):
        tried += 1
        candidate = with_layout(recipe, layout)
        try:
            problems = [p for p in rules(candidate, configs[0]) if p not in baseline] if rules else []
            if problems:
                raise ValueError(problems[0])
            plan = plan_on(candidate, cluster, known, configs, built)
        except ValueError as error:  # the model cannot be cut so (heads, layers, experts)
            reason = str(error).split(";")[0]
            refused[reason] = refused.get(reason, 0) + 1
            continue
        if plan["fits"]:
            found.append({"layout": layout, **{k: plan[k] for k in ("peak_bytes", "step_time_s", "samples_per_s",
                                                                     "tokens_per_s", "mfu", "dominant")}})
    return {"cluster": cluster, "tried": tried, "fitting": len(found), "refused": refused,
            "layouts": ranked(found)}


def ranked(found: List[Dict]) -> List[Dict]:
    """Fastest first; of layouts predicted alike (same speed and peak) only the simplest — the
    lowest ZeRO stage, the least recompute — is kept."""
    simplicity = {mode: i for i, mode in enumerate(RECOMPUTE_MODES)}
    order = sorted(found, key=lambda e: (-e["samples_per_s"], e["layout"]["parallel"]["zero_stage"],
                                         e["layout"].get("offload") is not None,
                                         simplicity[e["layout"]["recompute"]], e["peak_bytes"]))
    kept: List[Dict] = []
    seen = set()
    for entry in order:
        alike = (round(entry["samples_per_s"], 9), entry["peak_bytes"], entry["layout"]["micro_batch_size"],
                 tuple(v for k, v in sorted(entry["layout"]["parallel"].items()) if k != "zero_stage"))
        if alike not in seen:
            seen.add(alike)
            kept.append(entry)
    return kept


def _is_moe(config) -> bool:
    text = getattr(config, "text_config", config)
    return bool(getattr(text, "num_experts", 0) or getattr(text, "n_routed_experts", 0))


def render(result: Dict, top: int = 10) -> str:
    """The table of a search: the ``top`` fastest fitting layouts."""
    c = result["cluster"]
    lines = [f"{c['nodes']} x {c['devices_per_node']} {c['device']}: {result['tried']} layouts tried, "
             f"{result['fitting']} fit, {sum(result['refused'].values())} cannot be built",
             f"{'tp':>3} {'pp':>3} {'vpp':>3} {'cp':>3} {'ep':>3} {'zero':>4} {'recompute':>9} {'mbs':>3} "
             f"{'peak GiB':>8} {'step s':>8} {'samples/s':>9} {'MFU':>6}  dominant"]
    for entry in result["layouts"][:top]:
        p, layout = entry["layout"]["parallel"], entry["layout"]
        zero = f"{p['zero_stage']}{'+o' if layout.get('offload') else ''}"  # +o: the optimizer state offloaded
        lines.append(f"{p['tp']:>3} {p['pp']:>3} {p['vpp']:>3} {p['cp']:>3} {p['ep']:>3} {zero:>4} "
                     f"{layout['recompute']:>9} {layout['micro_batch_size']:>3} {entry['peak_bytes'] / 2 ** 30:>8.2f} "
                     f"{entry['step_time_s']:>8.3g} {entry['samples_per_s']:>9.3g} {entry['mfu']:>6.1%}  "
                     f"{entry['dominant']}")
    if not result["layouts"]:
        lines.append("no layout fits: add devices, train in bf16, or freeze / LoRA more of the model")
    return "\n".join(lines)
