"""The ``mm-train`` command.

    mm-train run [RECIPE] [--set section.key=value ...] [--nproc N] [--resume | --resume-from DIR] [--overwrite]
                 [--force]
    mm-train launch [RECIPE] --nnodes 2 --node-rank R --master-addr ADDR --master-port P [--nproc-per-node N]
                    (from a Slurm or Kubernetes job the node flags may be left out: mm_train.scheduler_env)
    mm-train recipes
    mm-train plan [RECIPE] [--set ...] [--nodes N] [--devices-per-node D] [--device NAME] [--json] [--search]
    mm-train convert ...
    mm-train generate SOURCE --prompt TEXT [--image FILE] --out FILE [--nproc N --set parallel.tp=2 ...]
    mm-train import KIND ...   (the family wing's commands, mm_train.registry.commands: another tool's files)

RECIPE is a YAML file or the name of a built-in recipe (``mm-train recipes`` lists them); ``run``
without one trains the built-in tiny default. With
``--nproc N > 1`` it checks the layout first, then starts msrun itself (N local workers on a free
port) running the same command in each worker. Before any process starts, ``run`` and ``launch``
refuse a layout whose plan (``mm-train plan`` on these machines) does not fit, unless ``--force``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional

from mm_train import convert, doctor, generate, registry
from mm_train.node_disks import NODE_VARIABLE
from mm_train.plan import command as plan_command
from mm_train.plan import refuse_unfitting
from mm_train.preflight import check_before_launch
from mm_train.recipe import build_recipe, check_layout, load_recipe
from mm_train.run_folder import check_unclaimed
from mm_train.scheduler_env import FIELDS as PLACE_FIELDS
from mm_train.scheduler_env import node_place
from mm_train.tested_versions import warn_untested
from mm_train.worker_output import LogRelay, report_failure

# Deferred imports: MindSpore, mm-parallel and mm_train.loop (which loads both): the CLI starts without
# loading MindSpore.

RECIPE_HELP = "a recipe YAML file or a built-in recipe's name (default: the built-in tiny default)"

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mm-train", description="Multimodal training on MindSpore.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="train a recipe (no recipe: the built-in tiny default)",
                              description="Train a recipe; without one, the built-in tiny default.")
    run.add_argument("recipe", nargs="?", help=RECIPE_HELP)
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override a recipe field, e.g. --set parallel.tp=2 --set train.steps=4 (repeatable)")
    run.add_argument("--nproc", type=int, default=1, help="local processes; > 1 starts msrun (default 1)")
    _run_folder_options(run)
    run.add_argument("--no-progress", action="store_true", help="no progress line (metrics.jsonl is still written)")
    run.add_argument("--timeout", type=float, default=24 * 3600.0,
                     help="with --nproc > 1: stop every worker after this many seconds (default a day)")
    launch = commands.add_parser(
        "launch", help="one node of a multi-node run (start it on every node)",
        description="Start this node's workers of a multi-node run: every node runs the same command with its "
                    "own --node-rank and the same --master-addr / --master-port (passed to msrun).")
    launch.add_argument("recipe", nargs="?", help=RECIPE_HELP)
    launch.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a recipe field (repeatable)")
    from_job = " (default: from the Slurm or Kubernetes job, mm_train.scheduler_env)"
    launch.add_argument("--nnodes", type=int, help="machines in the job" + from_job)
    launch.add_argument("--node-rank", type=int, help="this machine's index, 0 .. nnodes - 1" + from_job)
    launch.add_argument("--master-addr", help="address of node 0 (msrun's scheduler)" + from_job)
    launch.add_argument("--master-port", type=int, help="port of the scheduler on node 0" + from_job)
    launch.add_argument("--nproc-per-node", type=int,
                        help="workers on this machine (default: the recipe's cluster.devices_per_node, the job's "
                             "tasks per node or visible devices, else 1)")
    _run_folder_options(launch)
    launch.add_argument("--no-progress", action="store_true", help="no progress line")
    launch.add_argument("--timeout", type=float, default=24 * 3600.0, help="stop this node's workers after this long")
    launch.add_argument("--cluster-timeout", type=int, default=600,
                        help="seconds to wait for every node's workers to join (msrun's cluster_time_out)")
    commands.add_parser("recipes", help="list the built-in recipes",
                        description="The built-in recipes: name, family, what it trains, the machines it is for.")
    for command in (convert, plan_command, generate, doctor, *registry.commands().values()):
        command.add_parser(commands)
    return parser


def _run_folder_options(parser) -> None:
    parser.add_argument("--force", action="store_true",
                        help="start even when `mm-train plan` says the layout does not fit this machine's memory")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint in output_dir that verifies (any layout may resume "
                             "it)")
    parser.add_argument("--resume-from", metavar="CHECKPOINT",
                        help="continue from this checkpoint folder (OUT/checkpoints/step_N)")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over in an output_dir that holds another run: its checkpoints and metrics are "
                             "removed first")


def _recipes(args) -> int:
    rows = [(r.name, spec.name, r.trains, r.machines + (" (the default)" if r.default else ""))
            for spec, r in registry.recipes()]
    header = ("recipe", "family", "trains", "machines")
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(3)]
    for row in [header] + rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3])
    print("\nrun one with: mm-train run NAME [--set section.key=value ...]")
    return 0


def _run(args) -> int:
    from mm_parallel import runtime

    recipe = load_recipe(args.recipe, args.overrides)
    in_launch = "RANK_ID" in os.environ  # a worker msrun started
    runtime.chosen_device(recipe.train.device)  # a device this MindSpore cannot run: refused first
    if not in_launch:  # refused here, before any process starts
        check_layout(recipe, args.nproc)
        check_before_launch(recipe)
        refuse_unfitting(recipe, 1, args.nproc, args.force)
        check_unclaimed(recipe.output_dir, args.resume or bool(args.resume_from), args.overwrite)
    settle_runtime(recipe, in_launch)
    if args.nproc > 1 and not in_launch:
        return _launch(args, recipe)
    return _train(recipe, _run_options(args))


def _run_options(args) -> Dict:
    """What `loop.train` takes from the command line beside the recipe."""
    return {"progress": not args.no_progress, "resume": args.resume, "resume_from": args.resume_from,
            "overwrite": args.overwrite}


def _train(recipe, options: Mapping) -> int:
    """Train on this process (one of a launch, or alone) and say how it went (rank 0)."""
    from mm_train import loop

    metrics = loop.train(recipe, **options)
    if metrics and os.environ.get("RANK_ID", "0") == "0":
        first, last = metrics[0]["loss"], metrics[-1]["loss"]
        bad = loop.bad_sample_count(recipe.output_dir)
        skipped = f"; {bad} bad samples skipped ({os.path.join(recipe.output_dir, loop.BAD_SAMPLES)})" if bad else ""
        print(f"loss {first:.4f} -> {last:.4f} in {len(metrics)} steps; metrics in "
              f"{os.path.join(recipe.output_dir, 'metrics.jsonl')}{skipped}", file=sys.stderr)
    return 0


def settle_runtime(recipe, in_launch: bool) -> None:
    """Device and launch mode before any op runs (mm_parallel.runtime): the recipe's train.device
    (MM_DEVICE overrides it; every worker reads the recipe too), the launch-mode self-check run
    once per device and MindSpore version by the launcher, then both applied and said once; a
    MindSpore or transformers outside the tested table named first (never refused)."""
    from mm_parallel import runtime

    if not in_launch:
        warn_untested()

    target, _ = runtime.chosen_device(recipe.train.device)
    if (not in_launch and not os.environ.get("MM_LAUNCH_BLOCKING") and runtime.self_check_decides(target)
            and runtime.cached_self_check(target) is None):
        print(f"mm-train: checking asynchronous launch on {target} once (custom bprops, "
              f"{runtime.SELF_CHECK_STEPS} steps) ...", file=sys.stderr)
        runtime.self_check(target)
    decisions = runtime.configure(recipe.train.device)
    if not in_launch:
        print(f"mm-train: {decisions['device']}; {decisions['launch']}", file=sys.stderr)


RUN_RECORD = "run.json"  # beside the workers' logs: what every worker of a launch trains


def write_run_record(folder: Path, recipe, options: Mapping) -> Path:
    """The run as the launcher resolved it (the recipe with its file, --set values and defaults
    applied, as checkpoints record it; the command line's options), for its workers to load: they
    parse no YAML and no argv settings, so every worker trains what was checked before launch."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / RUN_RECORD
    staged = path.with_name(f".{RUN_RECORD}.tmp")
    staged.write_text(json.dumps({"recipe": recipe.to_dict(), "options": dict(options)}, indent=1, default=str))
    staged.rename(path)  # whole or absent: a worker never reads half a record
    return path


def recorded_run(path: str):
    """(recipe, options) of a run record (`write_run_record`)."""
    with open(path) as f:
        record = json.load(f)
    return build_recipe(record["recipe"]), record["options"]


def run_recorded(path: str) -> int:
    """A launched worker: train the run its launcher recorded (mm_train/_worker.py calls this)."""
    def train() -> int:
        recipe, options = recorded_run(path)
        settle_runtime(recipe, in_launch=True)
        return _train(recipe, options)

    return _guarded(train)


# CANN's default HCCL_EXEC_TIMEOUT (s): how long a collective on Ascend waits for its peers before
# HCCL fails it. Atlas training-series NPUs round the value down to a multiple of 68 (at least 68).
HCCL_DEFAULT_EXEC_TIMEOUT = 1836
WATCHDOG_FIRST_MARGIN = 60  # s: the watchdog checks every second; HCCL's error would name no rank


def worker_environment(recipe, pid_dir: str, environ: Mapping[str, str] = os.environ,
                       node_rank: int = 0) -> Dict[str, str]:
    """The variables msrun's workers get beside the launcher's own: where they record their pids,
    their node (``MM_TRAIN_NODE``: which ranks share a disk, `mm_train.node_disks`) and, for
    Ascend, HCCL_EXEC_TIMEOUT kept above train.collective_timeout, so that mm-train's watchdog
    reports a missing rank before HCCL ends the wait with an error that names none. It is only
    ever raised above CANN's default (checkpoint writing, exempt from the watchdog, still waits
    under HCCL's timeout) and a value the user exported is kept (with a warning when it is the
    shorter one). CPU collectives ignore the variable."""
    env = {"MM_TRAIN_PID_DIR": pid_dir, NODE_VARIABLE: str(node_rank)}
    timeout = recipe.train.collective_timeout
    if not timeout:
        return env
    wanted = -(-(int(timeout) + WATCHDOG_FIRST_MARGIN) // 68) * 68  # whole multiples of 68: no rounding down
    exported = environ.get("HCCL_EXEC_TIMEOUT")
    if exported is not None:
        try:
            seconds = float(exported or 0)
        except ValueError:
            raise ValueError(f"HCCL_EXEC_TIMEOUT={exported!r} is not a number of seconds; unset it or export "
                             f"e.g. {wanted}") from None
        if 0 < seconds < timeout:  # 0: HCCL never times out (Atlas A2 / A3)
            print(f"mm-train: HCCL_EXEC_TIMEOUT={exported} is below train.collective_timeout={timeout:g}: on "
                  f"Ascend HCCL ends a stuck collective first, without naming the missing rank; unset it or "
                  f"raise it to {wanted}", file=sys.stderr)
    elif wanted > HCCL_DEFAULT_EXEC_TIMEOUT:
        env["HCCL_EXEC_TIMEOUT"] = str(wanted)
    return env


def _launch(args, recipe, nnodes: int = 1, node_rank: int = 0, master_addr: str = "127.0.0.1",
            master_port: Optional[int] = None, cluster_timeout: Optional[int] = None) -> int:
    from mm_parallel.launch import DistributedRunError, launch

    local = args.nproc if nnodes == 1 else args.nproc_per_node
    log_dir = Path(recipe.output_dir) / "logs" / f"node_{node_rank}"
    shutil.rmtree(log_dir / "pids", ignore_errors=True)
    for old in log_dir.glob("worker_*.log"):  # a relay must not replay an earlier run's lines
        old.unlink()
    # rank 0's progress and summary in this terminal (on the node that holds rank 0)
    relay = LogRelay(log_dir / "worker_0.log") if node_rank == 0 else None
    print(f"mm-train: starting {local} workers (logs in {log_dir})", file=sys.stderr, flush=True)
    try:
        record = write_run_record(log_dir, recipe, _run_options(args))
        launch(Path(__file__).with_name("_worker.py"), local, ["--run-record", str(record)],
               timeout=args.timeout, log_dir=log_dir, nnodes=nnodes, node_rank=node_rank, master_addr=master_addr,
               master_port=master_port, cluster_timeout=cluster_timeout,
               env=worker_environment(recipe, str(log_dir / "pids"), node_rank=node_rank), tick=relay)
    except DistributedRunError as error:
        report_failure(log_dir, local, error)
        return 1
    print(f"worker logs in {log_dir}", file=sys.stderr)
    return 0


def _launch_node(args) -> int:
    recipe = load_recipe(args.recipe, args.overrides)
    place = node_place({name: getattr(args, name) for name in PLACE_FIELDS}, os.environ,
                       recipe.cluster.devices_per_node)
    for name, value in place.values.items():
        setattr(args, name, value)
    print(f"mm-train: this node: {place.describe()}", file=sys.stderr)
    check_layout(recipe, args.nnodes * args.nproc_per_node)
    check_before_launch(recipe)
    refuse_unfitting(recipe, args.nnodes, args.nproc_per_node, args.force)
    check_unclaimed(recipe.output_dir, args.resume or bool(args.resume_from), args.overwrite)
    settle_runtime(recipe, in_launch=False)  # each node's launcher checks its own devices
    return _launch(args, recipe, args.nnodes, args.node_rank, args.master_addr, args.master_port,
                   args.cluster_timeout)


# The optional packages behind mm-train's extras (pyproject.toml): a run that needs a missing one
# is told which extra to install; any other ImportError is a bug and keeps its traceback.
EXTRAS = {"mm_models_video": "video", "mm_models_vl": "vl", "mm_data": "data", "mm_profiling": "profiling",
          "tensorboardX": "tensorboard", "wandb": "wandb", "swanlab": "swanlab", "mlflow": "mlflow"}


def missing_extra(error: ImportError) -> Optional[str]:
    """The extra that installs the module ``error`` could not find, or None."""
    return EXTRAS.get((error.name or "").split(".")[0])


def main(argv: Optional[List[str]] = None) -> int:
    # transformers' "PyTorch was not found" notice means nothing to a MindSpore user; the variable
    # silences only transformers' advisory notices, and the msrun workers inherit it
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    args = _parser().parse_args(argv)
    return _guarded(lambda: _dispatch(args))


def _dispatch(args) -> int:
    if args.command == "run":
        return _run(args)
    if args.command == "launch":
        return _launch_node(args)
    if args.command == "recipes":
        return _recipes(args)
    if args.command == "doctor":
        return doctor.run(args)
    if args.command == "plan":
        return plan_command.run(args)
    if args.command == "generate":
        return generate.run(args)
    wing = registry.commands()
    if args.command in wing:
        return wing[args.command].run(args)
    return convert.run(args)


def _guarded(action: Callable[[], int]) -> int:
    """``action()``'s exit status, a user's error turned into its message and status 2 (a missing
    optional package names the extra to install), a stopped run into status 1."""
    try:
        return action()
    except ImportError as error:
        extra = missing_extra(error)
        if extra is None:  # not an optional package: a real import error, shown with its traceback
            raise
        print(f"mm-train: {error}; {error.name} comes with mm-train's {extra!r} extra: pip install "
              f"'mm-train[{extra}]' (or 'mm-train[all]')", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as error:  # the recipe or the command line
        print(f"mm-train: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:  # the run itself (e.g. non-finite losses)
        print(f"mm-train: the run stopped: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
