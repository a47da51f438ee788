"""Process settings decided before the first MindSpore op: the device, and blocking launch.

Device. ``train.device`` / ``MM_DEVICE`` (the environment wins): ``auto`` takes Ascend when
MindSpore reports it (``mindspore.device_context.ascend.is_available()``), else CPU; ``ascend``
on a MindSpore without it is an error saying what to install. `select_device` sets it once and
says how it was chosen (`decisions`).

Launch mode. Measured on MindSpore 2.7.2 CPU (PyNative, asynchronous op launch, the default): a
Cell's custom ``bprop`` is sometimes skipped while the backward runs. A loop of 300 steps through
four identity Cells whose bprop doubles the gradient got 13-36 steps wrong in a single process;
on several processes the ranks then issue different backward collectives, so all-reduces pair
unrelated tensors (silently wrong sums) or fail. Every communication region
(`mm_parallel.mappings`) is such a Cell. With blocking launch
(``mindspore.runtime.launch_blocking()``) the same loops are exact, and on CPU 4-5x faster.

Whether the device has the fault is found by `self_check`: that loop, run in a fresh process
with asynchronous launch on the device. Off CPU mm-train's launcher runs it on its host before it
starts any worker, once per `device_stack` — the host, its CANN and driver versions and
MindSpore's — and keeps the verdict in ``$MM_CACHE_DIR`` or ``~/.cache/mm`` under a name holding
all of them: a home directory shared by the nodes of a cluster holds one verdict per host, and a
new CANN, driver or MindSpore is checked again. On CPU blocking launch is always chosen: it is
the faster mode there, and the fault comes and goes (13-45 of 300 steps here, but one CI run's
check found 0 wrong; a lucky check had then switched later runs on that machine to the slow,
unsafe mode). On any other device asynchronous launch is earned: only a passed check on this
stack gives it (blocking costs a device its overlap, a skipped bprop costs correct gradients);
unchecked or failed, blocking. ``MM_LAUNCH_BLOCKING=1`` / ``0`` forces either.
The setting only takes effect before the process runs its first op (measured: switched on after
five steps, later steps still went wrong), so ``import mm_parallel`` applies it: import
mm_parallel before running any op.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple

import mindspore as ms

DEVICES = ("auto", "cpu", "ascend")
_TARGETS = {"cpu": "CPU", "ascend": "Ascend"}
SELF_CHECK_STEPS = 300
# The loop takes 10-12 s here; one CI run's loop hung under asynchronous launch for its whole
# 600 s limit. A hang is as unsafe as a skipped bprop, so past 12x the usual time it is a failure.
SELF_CHECK_TIMEOUT = 120.0
decisions: Dict[str, str] = {}  # {"device": how it was chosen, "launch": which mode and why}


def ascend_available() -> bool:
    """Whether this MindSpore can run on Ascend (CANN installed and MindSpore reporting a device).
    Without CANN (no ASCEND_HOME_PATH / ASCEND_TOOLKIT_HOME, no /usr/local/Ascend) MindSpore is not
    asked: asking logs a failed library load on every import."""
    if not (os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")
            or os.path.isdir("/usr/local/Ascend")):
        return False
    try:
        import mindspore.device_context.ascend as ascend

        return bool(ascend.is_available())
    except Exception:  # noqa: BLE001 - a build without the module has no Ascend
        return False


def chosen_device(setting: str = "auto", environ: Mapping[str, str] = os.environ,
                  available=ascend_available) -> Tuple[str, str]:
    """(MindSpore device target, how it was chosen) for a ``train.device`` setting; ``MM_DEVICE``
    in the environment overrides it."""
    source = "train.device"
    if environ.get("MM_DEVICE"):
        setting, source = environ["MM_DEVICE"], "MM_DEVICE"
    if setting not in DEVICES:
        raise ValueError(f"{source}={setting!r} is not a device; use one of {', '.join(DEVICES)}")
    if setting == "auto":
        if available():
            return "Ascend", f"{source}=auto: MindSpore reports Ascend"
        return "CPU", f"{source}=auto: MindSpore reports no Ascend"
    if setting == "ascend" and not available():
        raise ValueError(f"{source}=ascend, but this MindSpore cannot run on Ascend (install MindSpore 2.7.2's "
                           "Ascend build with its CANN, check that `npu-smi info` lists the devices), or set "
                           f"{source} to cpu / auto")
    return _TARGETS[setting], f"{source}={setting}"


def select_device(setting: str = "auto", environ: Mapping[str, str] = os.environ) -> str:
    """Set MindSpore's device from the setting (before any op); returns the target."""
    target, why = chosen_device(setting, environ)
    if ms.get_context("device_target") != target:
        ms.set_device(target)
    decisions["device"] = f"device {target} ({why})"
    return target


def _version_in(paths) -> Optional[str]:
    """The ``version=`` value of the first CANN / driver info file found."""
    for path in paths:
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition("=")
                    if key.strip().lower() in ("version", "package_version") and value.strip():
                        return value.strip().strip('"')
        except OSError:
            continue
    return None


def cann_and_driver() -> Tuple[Optional[str], Optional[str]]:
    """The installed CANN toolkit's and NPU driver's versions (None where not installed)."""
    home = os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME") or \
        "/usr/local/Ascend/ascend-toolkit/latest"
    cann = _version_in([os.path.join(home, name) for name in (
        "version.cfg", "compiler/version.info", "runtime/version.info",
        f"{os.uname().machine}-linux/ascend_toolkit_install.info")])
    driver = _version_in(["/usr/local/Ascend/driver/version.info"])
    return cann, driver


def device_stack(target: str) -> Dict[str, str]:
    """What a launch-mode verdict holds for: the device kind on this host, with its CANN, driver
    and MindSpore."""
    cann, driver = cann_and_driver()
    return {"target": target, "host": socket.gethostname(), "cann": cann or "none", "driver": driver or "none",
            "mindspore": ms.__version__}


def _cache_file(target: str) -> Path:
    root = Path(os.environ.get("MM_CACHE_DIR") or Path.home() / ".cache" / "mm")
    stack = device_stack(target)
    digest = hashlib.sha256(json.dumps(stack, sort_keys=True).encode()).hexdigest()[:16]
    host = re.sub(r"[^A-Za-z0-9._-]", "_", stack["host"])
    return root / f"launch_self_check-{target}-{host}-{digest}.json"


def cached_self_check(target: str) -> Optional[dict]:
    """The verdict kept for this host's device stack, if any."""
    try:
        check = json.loads(_cache_file(target).read_text())
    except (OSError, ValueError):
        return None
    return check if check.get("stack") == device_stack(target) else None


def keep_self_check(result: dict) -> Path:
    """Keep a `self_check` result for `launch_mode` (written whole: a reader never sees half)."""
    path = _cache_file(result["target"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)
    return path


def self_check_decides(target: str) -> bool:
    """Whether `launch_mode` on ``target`` follows the self-check (everywhere but CPU)."""
    return target != "CPU"


def launch_mode(target: str, environ: Mapping[str, str] = os.environ) -> Tuple[bool, str]:
    """(blocking, why) for a process on ``target``; see the module docstring."""
    forced = environ.get("MM_LAUNCH_BLOCKING")
    if forced in ("0", "1"):
        return forced == "1", f"MM_LAUNCH_BLOCKING={forced}"
    if forced:
        raise ValueError(f"MM_LAUNCH_BLOCKING must be 0 or 1, got {forced!r}")
    if not self_check_decides(target):
        return True, ("always on CPU: faster there, and asynchronous launch skips custom bprops now and then "
                      "(measured, DESIGN §4)")
    check = cached_self_check(target)
    where = f"{target} on {socket.gethostname()}"
    if check is None:
        return True, (f"unchecked on {where} with this CANN, driver and MindSpore: blocking until the self-check "
                      "passes (mm-train runs it before launching; `mm-train doctor` runs it too)")
    return not check["passed"], f"self-check on {where}: {verdict(check)}"


def verdict(check: dict) -> str:
    """What a self-check found, in words."""
    if isinstance(check["wrong"], str):  # "hung" or "crashed"
        return f"the loop {check['wrong']} under asynchronous launch"
    return f"{check['wrong']} of {check['steps']} steps wrong under asynchronous launch"


def wants_blocking_launch() -> bool:
    """Whether this process should launch ops synchronously (see the module docstring)."""
    return launch_mode(ms.get_context("device_target"))[0]


def configure(device: str = "auto"):
    """Select the device (MM_DEVICE, else ``device``) and the launch mode; called by ``import
    mm_parallel``, again by mm-train once the recipe is read (no op has run yet)."""
    target = select_device(device)
    blocking, why = launch_mode(target)
    if blocking and not decisions.get("launch", "").startswith("blocking"):  # once per process
        ms.runtime.launch_blocking()
    decisions["launch"] = f"{'blocking' if blocking else 'asynchronous'} launch ({why})"
    return decisions


# Four identity Cells whose bprop doubles the gradient: each of `steps` steps must equal the
# numpy gradient. Printed: "wrong W calls C" (C = 4 x steps when no bprop was skipped). With a
# third argument "mm_parallel", `import mm_parallel` first chooses the launch mode, as in a run.
_LOOP = """
import os, sys
if sys.argv[3:] == ["mm_parallel"]:
    import mm_parallel
import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
ms.set_device(sys.argv[1])
steps = int(sys.argv[2])
calls = []

class Doubling(nn.Cell):
    def construct(self, x):
        return x

    def bprop(self, x, out, dout):
        calls.append(1)
        return (dout * 2,)

rng = np.random.default_rng(0)
ws = [rng.standard_normal((8, 16 + 8 * i)).astype(np.float32) for i in range(4)]
x0 = rng.standard_normal((4, 8)).astype(np.float32)
weights = [Parameter(Tensor(w), name=f"w{i}") for i, w in enumerate(ws)]

def loss(x):
    return sum((ops.matmul(Doubling()(x), w) ** 2).sum() for w in weights)

grad = ms.grad(loss)
want = sum(4 * (x0 @ w) @ w.T for w in ws)
wrong = sum(not np.allclose(grad(Tensor(x0)).asnumpy(), want, rtol=1e-5) for _ in range(steps))
print("wrong", wrong, "calls", len(calls))
"""


def self_check(target: str, steps: int = SELF_CHECK_STEPS, timeout: float = SELF_CHECK_TIMEOUT, save: bool = True,
               through_mm_parallel: bool = False) -> dict:
    """Run the skipped-bprop loop in a fresh process with asynchronous launch on ``target``;
    returns {"passed", "wrong", "steps", "calls", "seconds", "target"} (and keeps it for
    `launch_mode` when ``save``). ``through_mm_parallel``: the launch mode ``import mm_parallel``
    chooses instead (what a run gets; not kept)."""
    env = dict(os.environ, MM_LAUNCH_BLOCKING="0", GLOG_v="3")
    if through_mm_parallel:
        env.pop("MM_LAUNCH_BLOCKING")
        save = False
    start = time.time()
    argv = [sys.executable, "-c", _LOOP, target, str(steps)] + (["mm_parallel"] if through_mm_parallel else [])
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        if through_mm_parallel:
            raise
        out = None
    # the loop's process dying under asynchronous launch (seen here: "The pointer[task] is null" in
    # MindSpore's async_rqueue.cc) or hanging makes that launch as unsafe as a skipped bprop
    failed = None if through_mm_parallel else ("hung" if out is None else "crashed" if out.returncode else None)
    words = out.stdout.split()[-4:] if out is not None else []
    if not failed and (out.returncode != 0 or len(words) != 4 or words[0] != "wrong"):
        raise RuntimeError(f"the launch-mode self-check failed to run on {target}: {out.stderr[-1500:]}")
    wrong, calls = (failed, 0) if failed else (int(words[1]), int(words[3]))
    result = {"passed": wrong == 0 and calls == 4 * steps, "wrong": wrong, "calls": calls, "steps": steps,
              "seconds": round(time.time() - start, 1), "target": target, "stack": device_stack(target)}
    if save:
        keep_self_check(result)
    return result
