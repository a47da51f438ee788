"""`mm-train doctor [--nproc N] [--json] [--recipe NAME ...]`: self-checks on the machine it runs on.

    versions      Python, MindSpore, numpy, CANN and the driver (where found), the mm packages and
                  their sibling ranges, against the supported table
    device        the device target and how it was chosen (mm_parallel.runtime)
    collectives   every collective on every group kind of a small layout, against numpy, on N
                  processes (msrun; mm_train.doctor.collectives)
    kernels       each fused kernel against the reference path, forward and backward, fp32 and bf16
                  (mm_train.doctor.kernels)
    attention     with --recipe: each attention call of the recipes at their per-rank shapes, fused
                  against reference, and probes of the kernel forms MindSpore's page forbids
                  (mm_train.doctor.recipe_attention)
    launch mode   the skipped-bprop self-check on this device and the launch mode it picks
    families      one training step of each registered family's tiny recipe

A table with pass / fail / skip, times and, for each failure, what to do; exit status 1 on any
failure. ``--json`` prints the same rows as JSON.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import tempfile
import time
import traceback
from importlib import metadata
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from mm_train import registry
from mm_train.doctor.collectives import run_checks
from mm_train.doctor.kernels import check_kernels
from mm_train.doctor.recipe_attention import check_recipe_attention, probe_undocumented_forms
from mm_train.recipe import load_recipe
from mm_train.tested_versions import TESTED

# Deferred imports: MindSpore, mm-parallel and mm_train.loop (which loads both): the CLI starts without
# loading MindSpore; packaging (only the version check of the mm packages uses it).

# Each tested MindSpore's companions as MindSpore Transformers' installation page pairs them (1.8.0:
# MindSpore 2.7.2 with CANN 8.5.0 and firmware & drivers 25.5.0; 1.9.0: 2.9.0 with 9.0.0 and 26.0.RC1);
# 2.8.0 and 2.10.0 have no such page, so their CANN and driver rows say so instead of judging.
SUPPORTED = {"python": "3.11", "numpy": "<2"}
COMPANIONS = {"2.7.2": {"cann": "8.5.0", "driver": "25.5.0"}, "2.9.0": {"cann": "9.0.0", "driver": "26.0.RC1"}}
PACKAGES = ("mm-parallel", "mm-profiling", "mm-data", "mm-models-vl", "mm-models-video", "mm-train")
FIX = {
    "versions": "install a tested MindSpore (pip install mindspore==2.7.2 'numpy<2'; tested: "
                + ", ".join(TESTED["mindspore"]) + ") and its CANN and driver from hiascend.com; "
                "reinstall mm packages whose ranges disagree",
    "device": "set train.device / MM_DEVICE (auto | cpu | ascend); for Ascend install MindSpore's Ascend build "
              "and CANN, and check `npu-smi info`",
    "collectives": "check HCCL: the network between the devices (hccn_tool), HCCL_IF_IP / HCCL_SOCKET_IFNAME, "
                   "and that every process sees its device (ASCEND_RT_VISIBLE_DEVICES)",
    "kernels": "the fused kernel disagrees with the reference path: set MM_KERNELS=reference to train without "
               "it and report the printed error with your CANN version",
    "launch": "the self-check could not run: see the error; MM_LAUNCH_BLOCKING=1 forces blocking launch",
    "families": "the family's tiny recipe failed one step: see the error (mm-train run NAME shows it in full)",
}


def _row(check: str, status: str, seconds: float = 0.0, detail: str = "", area: str = "") -> Dict:
    return {"check": check, "status": status, "seconds": round(seconds, 3), "detail": detail,
            "fix": FIX.get(area, "") if status == "fail" else ""}


def check_versions(target: str) -> List[Dict]:
    import mindspore as ms

    tested = ", ".join(TESTED["mindspore"])
    rows = [_row("version python", "pass" if platform.python_version().startswith(SUPPORTED["python"]) else "fail",
                 detail=f"{platform.python_version()} (supported {SUPPORTED['python']})", area="versions"),
            _row("version mindspore", "pass" if ms.__version__ in TESTED["mindspore"] else "fail",
                 detail=f"{ms.__version__} (tested {tested})", area="versions"),
            _row("version numpy", "pass" if int(np.__version__.split(".")[0]) < 2 else "fail",
                 detail=f"{np.__version__} (supported {SUPPORTED['numpy']})", area="versions")]
    from mm_parallel import runtime

    cann, driver = runtime.cann_and_driver()
    companions = COMPANIONS.get(ms.__version__)
    for name, found in (("cann", cann), ("driver", driver)):
        if found is None:
            status = "fail" if target == "Ascend" else "skip"
            detail = "not found" + ("" if target == "Ascend" else ": not needed on CPU")
        elif companions is None:
            status, detail = "skip", f"{found} (no published pairing for MindSpore {ms.__version__} to judge it by)"
        else:
            status = "pass" if found.startswith(companions[name]) else "fail"
            detail = f"{found} (MindSpore {ms.__version__}'s is {companions[name]})"
        rows.append(_row(f"version {name}", status, detail=detail, area="versions"))
    rows.append(_package_row(metadata))
    return rows


def _package_row(metadata) -> Dict:
    """The mm packages installed (the version their code says; an editable install's metadata
    keeps the version it was installed at) and whether each one's requirements on its siblings hold."""
    from packaging.requirements import Requirement

    versions, problems = {}, []
    for name in PACKAGES:
        try:
            versions[name] = importlib.import_module(name.replace("-", "_") + ".__about__").__version__
        except ImportError:
            continue
    for name in versions:
        for text in metadata.requires(name) or []:
            req = Requirement(text)
            if req.name in versions and not req.marker and versions[req.name] not in req.specifier:
                problems.append(f"{name} needs {req}, found {versions[req.name]}")
    detail = ", ".join(f"{k} {v}" for k, v in versions.items()) + ("; " + "; ".join(problems) if problems else "")
    return _row("version mm packages", "fail" if problems else "pass", detail=detail, area="versions")


def check_collectives(nproc: int, timeout: float) -> List[Dict]:
    if nproc < 2:
        return [_row("collectives", "skip", detail="one process: run with --nproc N >= 2 to check them")]
    from mm_parallel.launch import run_distributed

    start = time.perf_counter()
    try:
        ranks = run_distributed(run_checks, nproc, timeout, world=nproc)
    except Exception as error:  # noqa: BLE001 - the launch itself failed
        return [_row(f"collectives on {nproc} processes", "fail", time.perf_counter() - start, str(error)[-1500:],
                     "collectives")]
    rows = []
    for check in ranks[0]:
        results = [r[check] for r in ranks]
        failed = [f"rank {i}: {r['error']}" for i, r in enumerate(results) if not r["ok"]]
        rows.append(_row(f"collective {check}", "fail" if failed else "pass", max(r["seconds"] for r in results),
                         "; ".join(failed) or f"equal to numpy on {nproc} ranks", "collectives"))
    return rows


def check_launch_mode(target: str) -> List[Dict]:
    from mm_parallel import runtime

    start = time.perf_counter()
    try:
        result = runtime.self_check(target)
    except Exception as error:  # noqa: BLE001
        return [_row("launch-mode self-check", "fail", time.perf_counter() - start, str(error)[-1500:], "launch")]
    blocking, why = runtime.launch_mode(target)
    forced = "" if why.startswith("self-check") else f" ({why})"  # forced, or CPU (always blocking)
    stack = result["stack"]
    # a failed check is a finding, not a failure: runs then use blocking launch
    return [_row("launch-mode self-check", "pass", result["seconds"],
                 f"{runtime.verdict(result)} on {stack['host']} "
                 f"(CANN {stack['cann']}, driver {stack['driver']}, MindSpore {stack['mindspore']}): runs use "
                 f"{'blocking' if blocking else 'asynchronous'} launch{forced}")]


def _tiny_recipe(spec) -> Optional[str]:
    """The family's tiny built-in recipe (its name ends in _tiny), else its first CPU recipe."""
    tiny = [r.name for r in spec.recipes if r.name.endswith("_tiny")]
    return (tiny or [r.name for r in spec.recipes if "CPU" in r.machines] or [None])[0]


def check_families(workdir: str) -> List[Dict]:
    """One training step of each family's tiny recipe, in this process (data generated in workdir)."""
    from mm_train import loop

    rows = []
    before = os.environ.get("MM_TRAIN_DATA")
    os.environ["MM_TRAIN_DATA"] = os.path.join(workdir, "data")
    try:
        for name, spec in registry.families().items():
            recipe_name = _tiny_recipe(spec)
            if recipe_name is None:
                rows.append(_row(f"family {name}", "skip", detail="no tiny built-in recipe"))
                continue
            start = time.perf_counter()
            try:
                recipe = load_recipe(recipe_name, ["train.steps=1", "train.log_every=1", "checkpoint.every=0",
                                                   f"output_dir={os.path.join(workdir, recipe_name)}"])
                metrics = loop.train(recipe, progress=False, overwrite=True)
                rows.append(_row(f"family {name}", "pass", time.perf_counter() - start,
                                 f"{recipe_name}: one step, loss {metrics[-1]['loss']:.4f}"))
            except Exception:  # noqa: BLE001 - reported per family
                rows.append(_row(f"family {name}", "fail", time.perf_counter() - start,
                                 f"{recipe_name}: {traceback.format_exc(limit=3)}", "families"))
    finally:
        if before is None:
            os.environ.pop("MM_TRAIN_DATA", None)
        else:
            os.environ["MM_TRAIN_DATA"] = before
    return rows


def diagnose(nproc: int = 1, timeout: float = 600.0, families: bool = True,
             recipes: Sequence[Tuple[str, List[str]]] = ()) -> List[Dict]:
    """Every row of the doctor's table (see the module docstring); ``recipes``: (name or path,
    overrides) whose attention shapes to check, with the probes of the undocumented forms."""
    import mindspore as ms

    from mm_parallel import runtime

    runtime.configure()
    target = ms.get_context("device_target")
    rows = check_versions(target)
    rows.append(_row("device", "pass", detail=runtime.decisions["device"]))
    rows += check_collectives(nproc, timeout)
    rows += check_kernels(target == "Ascend")
    if recipes:
        rows += check_recipe_attention(list(recipes), target == "Ascend")
        rows += probe_undocumented_forms(target == "Ascend")
    rows += check_launch_mode(target)
    if families:
        with tempfile.TemporaryDirectory(prefix="mm_doctor_") as workdir:
            rows += check_families(workdir)
    return rows


def render(rows: List[Dict]) -> str:
    """The rows as a table, then what to do for each failure."""
    width = max(len(r["check"]) for r in rows)
    lines = [f"{'check'.ljust(width)}  status  seconds  detail"]
    for r in rows:
        first = (r["detail"].strip().splitlines() or [""])[-1 if r["status"] == "fail" else 0]
        lines.append(f"{r['check'].ljust(width)}  {r['status'].ljust(6)}  {r['seconds']:7.2f}  {first[:160]}")
    failed = [r for r in rows if r["status"] == "fail"]
    counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", "fail", "skip")}
    lines.append(f"\n{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped")
    for r in failed:
        lines.append(f"\nFAIL {r['check']}: {r['detail'].strip()}\n  what to do: {r['fix']}")
    return "\n".join(lines)


def run(args) -> int:
    rows = diagnose(args.nproc, args.timeout, not args.skip_families, [(r, args.overrides) for r in args.recipe])
    print(json.dumps({"rows": rows}, indent=1) if args.json else render(rows))
    return 1 if any(r["status"] == "fail" for r in rows) else 0


def add_parser(sub) -> None:
    doctor = sub.add_parser("doctor", help="self-checks on this machine: versions, device, collectives, kernels, "
                                           "launch mode, one step per family (the first command on a new cluster)")
    doctor.add_argument("--nproc", type=int, default=1, help="processes for the collective checks (msrun; >= 2)")
    doctor.add_argument("--json", action="store_true", help="print the rows as JSON")
    doctor.add_argument("--timeout", type=float, default=600.0, help="seconds for the collective launch")
    doctor.add_argument("--skip-families", action="store_true", help="leave out the per-family training steps")
    doctor.add_argument("--recipe", action="append", default=[],
                        help="a recipe (name or YAML) whose attention shapes to run through the kernel, per rank; "
                             "repeatable. Also probes the kernel forms MindSpore's page forbids")
    doctor.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key of every --recipe (e.g. model.path=/models/my-model: its config.json)")
