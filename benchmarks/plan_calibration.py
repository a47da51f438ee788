"""`mm-train plan`'s throughput against MindSpeed-MM's published figures: the efficiencies fitted
per device and framework, each figure's prediction, error and leave-one-out error, side by side.

    python benchmarks/plan_calibration.py

The figures, where each was read, its column, device and framework, and the layout and shapes of
the example script that produced it, are the table `mm_train/plan/calibration.yaml`. Each figure
is planned as its framework runs it (`mm_train.plan.timing.FRAMEWORKS`: torch_npu's pipeline
keeps the forward's graph, so it adds no recomputation and runs a frozen tower once) on our
built-in recipe of the family with the published checkpoint's config.json
(tests/mm_train/data/hub_configs.json). A plan's step is

    S = A / E + D / E_e + B P + C

A the compute and bubble at the full peak, E the share of it reached; D online encoding at the full
peak over its own efficiency E_e (the VAE's 3-D convolutions are not the matrix products E
measures); B the layer passes, P what one costs beyond its FLOPs (launches, host work); C the
communication at devices.yaml's link efficiency. Per calibration group (devices.yaml: the 910B
variants share one, the A3 die has its own), E and P are fitted by least squares of the log
errors over a grid (E 0.050 .. 1.000, P 0 .. 3 ms; the smallest P among equal fits) on the
figures that do not encode, then E_e on those that do; a group with fewer than two figures that
do not encode (the A3 die's: one VL run, two Wan2.2 runs that encode) fits E alone on all its
figures, P and E_e taken from the group with the most figures (the 910B's: the same software
stack). A figure's leave-one-out error is its error under the constants fitted without it, given
where at least two other figures of its group fit them (for an encoding figure of a group that
fits all three: two others that encode). Figures marked left out (not Ascend
measurements, or revised) are printed with their reason and their group's prediction, never fitted.
Every fitted figure's plan must also fit the device's memory: a published run whose planned peak
passes the memory a run may use (memory_gib x usable_fraction; `mm-train plan`'s own verdict keeps
another 10 % for the user's margin, plan.HEADROOM) is a miss of the memory model.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from helpers.hub_folders import HUB_CONFIGS, write_hub_folder  # noqa: E402  (the published shapes, in the tests' data)

GOAL, SHARE = 0.25, 0.8  # leave-one-out within 25 % on at least 80 % of the figures that have one
# whose pipeline a framework's figures are planned with: MindSpeed-MM's MindSpore backend is taken
# to share MindSpore's PyNative limit (mm's: the stage's forward again in its backward)
PIPELINE_OF = {"torch_npu": "torch_npu", "mindspore": "mm"}


def load_table() -> dict:
    """calibration.yaml with each figure's ``sets`` expanded (``*name``: the common list ``name``)."""
    import mm_train.plan

    table = yaml.safe_load(Path(mm_train.plan.__file__).with_name("calibration.yaml").read_text())
    for figure in table["figures"]:
        figure["sets"] = [s for item in figure["sets"] for s in
                          (table["common"][item[1:]] if item.startswith("*") else [item])]
    return table


def model_folder(figure: dict) -> str:
    """A folder with the figure's model: hub_configs' ``config`` with ``config_changes`` as its
    config.json, or a diffusers pipeline folder (``pipeline``, written by the tests' helper)."""
    root = tempfile.mkdtemp(prefix="calibration_")
    if "pipeline" in figure:
        return write_hub_folder(os.path.join(root, figure["pipeline"]), figure["pipeline"])
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump({**HUB_CONFIGS[figure["config"]], **figure.get("config_changes", {})}, f)
    return root


def step_parts(figure: dict) -> dict:
    """{compute (s at E = 1, bubble included), encode (s at E_e = 1), launch (s at P = 1 ms),
    communication (s), scale (the figure's unit times the step: samples of the cluster, or tokens
    of one published device: ``dies_per_device`` of ours), group, fits, peak_gib} of one figure's plan."""
    from mm_train.plan import load_devices, model_config, plan_on
    from mm_train.recipe import load_recipe

    recipe = load_recipe(figure["recipe"], [f"model.path={model_folder(figure)}", *figure["sets"]])
    known = load_devices()
    group = known["devices"][figure["device"]]["calibration"]
    known["calibrated"] = {}
    known["efficiency"] = {**known["efficiency"], "compute": 1.0, "layer_pass_ms": 1.0, "encode": 1.0}
    cluster = {"nodes": 1, "devices_per_node": 8, **figure.get("cluster", {}), "device": figure["device"]}
    plan = plan_on(recipe, cluster, known, model_config(recipe), framework=PIPELINE_OF[figure["framework"]])
    parts = plan["breakdown"]
    compute = parts["compute"] + parts["bubble"]
    metric = "samples_per_s" if figure["unit"] == "SPS" else "tokens_per_s_per_device"
    usable = plan["device_memory_bytes"] * known["devices"][figure["device"]]["usable_fraction"]
    return {"compute": compute, "encode": parts["encode"], "launch": parts["launch"],
            "communication": plan["step_time_s"] - compute - parts["encode"] - parts["launch"],
            "scale": plan[metric] * plan["step_time_s"] * figure.get("dies_per_device", 1), "group": group,
            "fits": plan["peak_bytes"] <= usable, "peak_gib": plan["peak_bytes"] / 2 ** 30}


def predicted(parts: dict, efficiency: float, layer_pass_ms: float, encode: float) -> float:
    return parts["scale"] / (parts["compute"] / efficiency + parts["encode"] / encode + parts["launch"] * layer_pass_ms
                             + parts["communication"])


def fit(parts, published):
    """(E, P in ms, E_e) fitted on figures (module docstring; E_e = E when none encodes)."""
    plain = [(p, v) for p, v in zip(parts, published) if not p["encode"]]
    encoding = [(p, v) for p, v in zip(parts, published) if p["encode"]]
    e = np.arange(50, 1001)[:, None] / 1000
    q = np.arange(0, 301)[None, :] / 100
    error = sum(np.log(p["scale"] / (p["compute"] / e + p["launch"] * q + p["communication"]) / v) ** 2
                for p, v in plain)
    i, j = np.unravel_index(np.argmin(error + q * 1e-12), error.shape)
    efficiency, layer_pass = float(e[i, 0]), float(q[0, j])
    if not encoding:
        return efficiency, layer_pass, efficiency
    grid = np.arange(5, 1001) / 1000
    error = sum(np.log(predicted(p, efficiency, layer_pass, grid) / v) ** 2 for p, v in encoding)
    return efficiency, layer_pass, float(grid[np.argmin(error)])


def fit_compute_only(parts, published, layer_pass: float, encode: float):
    """(E, P, E_e) with P and E_e given: E alone fitted on every figure (a group too small to fit P
    and E_e takes them from the largest group, module docstring)."""
    e = np.arange(50, 1001) / 1000
    error = sum(np.log(predicted(p, e, layer_pass, encode) / v) ** 2 for p, v in zip(parts, published))
    return float(e[np.argmin(error)]), layer_pass, encode


def determined(parts) -> bool:
    """Whether figures determine E and P: at least two that do not encode."""
    return sum(not p["encode"] for p in parts) >= 2


def fitted_groups(figures, parts, leave_out=None) -> dict:
    """{group: (E, P, E_e)} fitted on each group's figures marked ``use: fit`` (but ``leave_out``, an
    index); a group whose figures do not determine P (`determined`) fits E alone and takes P and
    E_e from the group with the most figures."""
    members = {}
    for i, (f, p) in enumerate(zip(figures, parts)):
        if f["use"] == "fit" and i != leave_out:
            members.setdefault(p["group"], []).append((p, f["figure"]))
    largest = max(members, key=lambda g: len(members[g]))
    groups = {largest: fit(*zip(*members[largest]))}
    for group, mine in members.items():
        if group != largest:
            ps, vs = zip(*mine)
            groups[group] = fit(ps, vs) if determined(ps) else fit_compute_only(ps, vs, *groups[largest][1:])
    return groups


def leave_one_out(figures, parts, index: int):
    """The error of figure ``index`` under its group's constants fitted without it, or None when
    fewer than two other figures of the group fit the constants it depends on (module docstring)."""
    me = parts[index]
    others = [p for i, (f, p) in enumerate(zip(figures, parts))
              if i != index and f["use"] == "fit" and p["group"] == me["group"]]
    if determined(others):  # E and P from the plain figures, E_e from the encoding ones
        enough = len([p for p in others if bool(p["encode"]) == bool(me["encode"])]) >= 2
    else:  # E alone, from every other figure
        enough = len(others) >= 2
    if not enough:
        return None
    constants = fitted_groups(figures, parts, leave_out=index)[me["group"]]
    return predicted(me, *constants) / figures[index]["figure"] - 1


def rows(table=None):
    """Every figure's {name, device, framework, column, unit, figure, predicted, error, loo,
    fits, peak_gib, use, reason}, and the fitted constants per group."""
    table = table or load_table()
    figures = table["figures"]
    parts = [step_parts(f) for f in figures]
    groups = fitted_groups(figures, parts)
    out = []
    for i, (f, p) in enumerate(zip(figures, parts)):
        guess = predicted(p, *groups[p["group"]])
        out.append({"name": f["name"], "device": f["device"], "framework": f["framework"], "column": f["column"],
                    "unit": f["unit"], "figure": f["figure"], "predicted": guess, "error": guess / f["figure"] - 1,
                    "loo": leave_one_out(figures, parts, i) if f["use"] == "fit" else None, "fits": p["fits"],
                    "peak_gib": p["peak_gib"], "use": f["use"], "reason": f.get("reason", "")})
    return out, groups


def main():
    out, groups = rows()
    print(f"{'figure':<46} {'device':<12} {'col.':<4} {'unit':<4} {'published':>9} {'predicted':>9} {'error':>7} "
          f"{'leave-1-out':>11} {'GiB':>5} fits")
    for r in out:
        loo = f"{r['loo']:>+11.1%}" if r["loo"] is not None else f"{'-':>11}"
        print(f"{r['name']:<46} {r['device']:<12} {r['column'][:4]:<4} {r['unit']:<4} {r['figure']:>9.4g} "
              f"{r['predicted']:>9.4g} {r['error']:>+7.1%} {loo} {r['peak_gib']:>5.1f} {'yes' if r['fits'] else 'NO'}"
              + (f"  left out: {r['reason']}" if r["use"] != "fit" else ""))
    for group, (e, p, ee) in groups.items():
        print(f"fitted {group}: compute efficiency {e:.3f}, {p:.2f} ms per layer pass, online encoding {ee:.3f} "
              "(devices.yaml calibrated)")
    fitted = [r for r in out if r["use"] == "fit"]
    judged = [r for r in fitted if r["loo"] is not None]
    within = sum(abs(r["loo"]) <= GOAL for r in judged)
    print(f"leave-one-out within {GOAL:.0%}: {within} of {len(judged)} figures ({within / len(judged):.0%}; goal "
          f">= {SHARE:.0%}); worst error {max(abs(r['error']) for r in fitted):.1%}; published runs planned not to "
          f"fit: {sum(not r['fits'] for r in fitted)}")


if __name__ == "__main__":
    main()
