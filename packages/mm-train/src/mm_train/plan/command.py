"""The ``mm-train plan`` command line (mm_train.plan does the work)."""

from __future__ import annotations

import json
import sys

from mm_train.plan import make_plan, render, search
from mm_train.plan.explain import explain
from mm_train.recipe import load_recipe


def add_parser(commands) -> None:
    plan = commands.add_parser(
        "plan", help="predict memory per device, step time and throughput of a recipe on a cluster",
        description="Predict a recipe's memory per device, step time, samples / tokens per second and MFU on its "
                    "cluster (the recipe's cluster section; the flags override it), from the recipe and the model's "
                    "config.json only.")
    plan.add_argument("recipe", nargs="?", help="a recipe YAML file or a built-in recipe's name")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                      help="override a recipe field (repeatable)")
    plan.add_argument("--nodes", type=int, help="servers (default: cluster.nodes)")
    plan.add_argument("--devices-per-node", type=int, help="devices per server (default: cluster.devices_per_node)")
    plan.add_argument("--device", help="a device of devices.yaml (default: cluster.device)")
    plan.add_argument("--devices", dest="devices_file", help="a YAML file of more devices (devices.yaml's layout)")
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    plan.add_argument("--search", action="store_true",
                      help="plan every layout (tp, pp, vpp, cp, ep, ZeRO stage, recompute, micro-batch size) of the "
                           "cluster and list those that fit, fastest first")
    plan.add_argument("--explain", action="store_true",
                      help="break the step time into its terms (compute per stack, encoders, communication per "
                           "group, pipeline bubble, optimizer, launch time) and the assumptions behind them")
    plan.add_argument("--top", type=int, default=10, help="with --search: layouts shown in the table (default 10)")


def run(args) -> int:
    recipe = load_recipe(args.recipe, args.overrides)
    if args.search:
        result = search.search(recipe, args.nodes, args.devices_per_node, args.device, args.devices_file)
        print(json.dumps(result, indent=2) if args.json else search.render(result, args.top))
        return 0 if result["layouts"] else 3
    plan = make_plan(recipe, args.nodes, args.devices_per_node, args.device, args.devices_file)
    print(json.dumps(plan, indent=2) if args.json else render(plan))
    if args.explain and not args.json:
        print(explain(plan))
    if not plan["fits"]:
        print("mm-train: the plan does not fit: raise tp / pp / the ZeRO stage, recompute, or add devices",
              file=sys.stderr)
    return 0 if plan["fits"] else 3
