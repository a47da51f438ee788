"""Count the host round trips a piece of code makes: device-to-host reads and host-made tensors.

    with host_transfers() as seen:
        loss = train_step()
    seen.reads, seen.uploads            # how many
    seen.sites()                        # {"mm_parallel/optimizer.py:159 asnumpy": 2, ...}

Reads: ``Tensor.asnumpy``, ``item``, ``tolist`` and the conversions ``float()``, ``int()``,
``bool()`` of a tensor (each waits for the device and copies to the host). Uploads: a
``Tensor`` built from a numpy array or a Python list / number (a host-to-device copy). Each is
attributed to the innermost frame of the caller's code that is not MindSpore's and not the
test-only stand-ins (mm_parallel.testing.ascend_kernels / hccl read the host by design: they
stand in for device kernels).
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from mindspore import Tensor

_READS = ("asnumpy", "item", "tolist", "__float__", "__int__", "__bool__", "__index__")
_SKIPPED = ("/mindspore/", "mm_parallel/testing/ascend_kernels.py", "mm_parallel/testing/flash_attention.py",
            "mm_parallel/testing/flash_attention_contract.py", "mm_parallel/testing/hccl.py",
            "mm_parallel/testing/host_transfers.py", "mm_parallel/testing/device_path.py")


@dataclass
class HostTransfers:
    counts: Counter = field(default_factory=Counter)  # (site, kind) -> calls
    depth: int = 0  # > 0 while inside a counted call (a read that reads: counted once)

    @property
    def reads(self) -> int:
        return sum(n for (site, kind), n in self.counts.items() if kind != "upload")

    @property
    def uploads(self) -> int:
        return sum(n for (site, kind), n in self.counts.items() if kind == "upload")

    def sites(self) -> dict:
        return {f"{site} {kind}": n for (site, kind), n in self.counts.most_common()}


def _site() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if not any(part in path for part in _SKIPPED):
            short = path.split("/src/")[-1] if "/src/" in path else path.rsplit("/", 2)[-1]
            return f"{short}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _stand_in_only() -> bool:
    """Whether the nearest non-MindSpore caller is a stand-in (its host reads are the device's work)."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if "/mindspore/" not in path and "host_transfers.py" not in path:
            return any(part in path for part in _SKIPPED[1:])
        frame = frame.f_back
    return False


@contextlib.contextmanager
def host_transfers():
    """Count reads and uploads made inside the with block (see the module docstring)."""
    seen = HostTransfers()
    saved = {name: getattr(Tensor, name) for name in _READS + ("__init__",) if hasattr(Tensor, name)}

    def counted(name, original):
        def call(self, *args, **kwargs):
            if seen.depth == 0 and not _stand_in_only():
                seen.counts[_site(), name.strip("_")] += 1
            seen.depth += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                seen.depth -= 1
        return call

    def init(self, input_data=None, *args, **kwargs):
        if seen.depth == 0 and isinstance(input_data, (np.ndarray, np.generic, list, tuple, int, float, bool)) \
                and not _stand_in_only():
            seen.counts[_site(), "upload"] += 1
        seen.depth += 1
        try:
            return saved["__init__"](self, input_data, *args, **kwargs)
        finally:
            seen.depth -= 1

    for name in _READS:
        if name in saved:
            setattr(Tensor, name, counted(name, saved[name]))
    Tensor.__init__ = init
    try:
        yield seen
    finally:
        for name, original in saved.items():
            setattr(Tensor, name, original)
