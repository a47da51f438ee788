"""The ``mm-train`` command.

    mm-train run [RECIPE] [--set section.key=value ...] [--nproc N] [--resume]

``run`` without a recipe trains the built-in tiny default (recipes/qwen2_5_vl_tiny.yaml). With
``--nproc N > 1`` it checks the layout first, then starts msrun itself (N local workers on a free
port) running the same command in each worker.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mm-train", description="Multimodal training on MindSpore.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="train a recipe (no recipe: the built-in tiny default)",
                              description="Train a recipe; without one, the built-in tiny Qwen2.5-VL default.")
    run.add_argument("recipe", nargs="?", help="a recipe YAML file (default: the built-in tiny Qwen2.5-VL)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override a recipe field, e.g. --set parallel.tp=2 --set train.steps=4 (repeatable)")
    run.add_argument("--nproc", type=int, default=1, help="local processes; > 1 starts msrun (default 1)")
    run.add_argument("--resume", action="store_true",
                     help="continue from the newest complete checkpoint in output_dir (any layout may resume it)")
    run.add_argument("--no-progress", action="store_true", help="no progress line (metrics.jsonl is still written)")
    run.add_argument("--timeout", type=float, default=24 * 3600.0,
                     help="with --nproc > 1: stop every worker after this many seconds (default a day)")
    return parser


def _run(args) -> int:
    from mm_train.recipe import check_layout, load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    in_launch = "RANK_ID" in os.environ  # a worker msrun started
    if args.nproc > 1 and not in_launch:
        check_layout(recipe, args.nproc)  # refused here, before any process starts
        return _launch(args)
    if args.nproc == 1 and not in_launch:
        check_layout(recipe, 1)
    from mm_train.vl_trainer import train

    metrics = train(recipe, progress=not args.no_progress, resume=args.resume)
    if metrics and os.environ.get("RANK_ID", "0") == "0":
        first, last = metrics[0]["loss"], metrics[-1]["loss"]
        print(f"loss {first:.4f} -> {last:.4f} in {len(metrics)} steps; metrics in "
              f"{os.path.join(recipe.output_dir, 'metrics.jsonl')}", file=sys.stderr)
    return 0


def _launch(args) -> int:
    from pathlib import Path

    from mm_parallel.testing import DistributedRunError, launch

    argv = [a for a in sys.argv[1:]]
    script = Path(__file__).with_name("_worker.py")
    log_dir = Path(load_output_dir(args)) / "logs"
    try:
        launch(script, args.nproc, argv, timeout=args.timeout, log_dir=log_dir)
    except DistributedRunError as error:
        print(f"mm-train: the run failed: {error}", file=sys.stderr)
        return 1
    print(f"worker logs in {log_dir}", file=sys.stderr)
    return 0


def load_output_dir(args) -> str:
    from mm_train.recipe import load_recipe

    return load_recipe(args.recipe, args.overrides).output_dir


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
    except (ValueError, FileNotFoundError, ImportError) as error:
        print(f"mm-train: {error}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
