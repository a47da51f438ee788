"""`mm-train import`: another trainer's configuration turned into one mm recipe (a command of the
family wing: those configurations name models; the CLI finds it through the registry).

    mm-train import llamafactory CONFIG.yaml [--nproc N] [-o recipe.yaml]
    mm-train import mindspeed SCRIPT.sh [--model MODEL_JSON] [--data DATA_JSON] [--var NAME=VALUE ...] [-o recipe.yaml]

An importer reads the other tool's files (never runs them) and fills an `Imported`: the recipe as
a YAML file holds it, and every setting it could not carry over with the reason. The left-out
settings head the written recipe as comments and are printed; the recipe is then built and checked
as `mm-train run` would (`recipe.build_recipe`, `recipe.check_layout` at the source's world size).
One the check refuses (a data path the source could not give) is still written, and the command
fails with the check's message, which names what to set.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mm_train.families.importing import llamafactory, mindspeed
from mm_train.families.importing.imported import Imported
from mm_train.recipe import build_recipe, check_layout
from mm_train.registry import CommandSpec


def checked(imported: Imported) -> None:
    """Build the recipe as `mm-train run` does and check its layout at the source's world size."""
    recipe = build_recipe(imported.recipe)
    check_layout(recipe, imported.world_size or recipe.cluster.nodes * recipe.cluster.devices_per_node)


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "import", help="turn a LLaMA-Factory training YAML or a MindSpeed-MM launch script into an mm recipe",
        description="Read another trainer's configuration (never run it) and write one mm recipe; every setting "
                    "that has no mm equivalent or cannot be read is listed with the reason.")
    kinds = parser.add_subparsers(dest="kind", required=True)
    factory = kinds.add_parser("llamafactory", help="a LLaMA-Factory training YAML (llamafactory-cli train ...)")
    factory.add_argument("config", help="the training YAML")
    factory.add_argument("--nproc", type=int, default=1,
                         help="the processes it ran on (its global batch: per-device batch x accumulation x these)")
    factory.add_argument("-o", "--output", help="the recipe to write (default: print it)")
    speed = kinds.add_parser("mindspeed", help="a MindSpeed-MM launch script (examples/.../*.sh) with its JSON")
    speed.add_argument("script", help="the launch script (read, never run)")
    speed.add_argument("--model", help="its --mm-model JSON (default: the path the script names)")
    speed.add_argument("--data", help="its --mm-data JSON (default: the path the script names)")
    speed.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                       help="a shell variable's value in place of the script's (e.g. NNODES=4 where the script "
                            "counts a hostfile); repeatable")
    speed.add_argument("-o", "--output", help="the recipe to write (default: print it); a dataset_info.json it "
                                              "needs is written beside it")


def run(args) -> int:
    if args.kind == "mindspeed":
        beside = Path(args.output).resolve().parent if args.output else Path.cwd()
        given = dict(v.split("=", 1) for v in args.var if "=" in v)
        if len(given) != len(args.var):
            raise ValueError(f"--var takes NAME=VALUE, got {[v for v in args.var if '=' not in v]}")
        imported = mindspeed.import_script(Path(args.script), args.model, args.data, beside, given)
    else:
        imported = llamafactory.import_config(Path(args.config), nproc=args.nproc)
    text = imported.yaml_text()
    for setting, reason in imported.left_out:
        print(f"mm-train import: not carried over: {setting}: {reason}", file=sys.stderr)
    if imported.not_needed:
        print(f"mm-train import: read, not needed by mm: {', '.join(imported.not_needed)}", file=sys.stderr)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)
        print(f"mm-train import: wrote {args.output} ({len(imported.left_out)} settings not carried over)",
              file=sys.stderr)
    else:
        print(text, end="")
    checked(imported)  # written first: what it still needs (a data path the source could not give) is named
    return 0


COMMAND = CommandSpec("import", add_parser, run)
