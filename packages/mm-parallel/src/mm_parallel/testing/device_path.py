"""Run the Ascend path on CPU: fused kernels and the native (HCCL) backend, against stand-ins.

    with ascend_stand_ins():            # or install_ascend_stand_ins() in a worker, before comm
        loss = model(**batch).loss      # flash_attention_score, rms_norm, rope, swiglu, grouped
                                        # matmul, the flash attention primitives
                                        # and mint.distributed's HCCL calls are stand-ins

What changes: `mm_parallel.ops.device.set_kernels("fused")` (every ``use_fused()`` branch
taken); the Ascend kernels mm calls replaced by mm_parallel.testing.ascend_kernels; the
communication backend the native one, calling mm_parallel.testing.hccl in place of
mindspore.mint.distributed (each stand-in the documented semantics of the MindSpore 2.7 call).
``float32=True`` (the default) widens flash attention to float32 (the stand-ins' one deliberate
deviation, ascend_kernels' docstring says why) so a float32 model takes the fused attention too.
Everything is restored on exit.
"""

from __future__ import annotations

import contextlib
import importlib
import types
from typing import Callable, List, Optional

import mindspore as ms
import mindspore.ops as ms_ops
import mindspore.ops.auto_generate as auto_generate

from mm_parallel.testing import ascend_kernels, hccl

KERNELS = ("flash_attention_score", "rms_norm", "rotary_position_embedding", "swiglu")
PRIMITIVES = ("FlashAttentionScore", "FlashAttentionScoreGrad")  # ring attention's: softmax statistics
RING_CALLS = set(PRIMITIVES)  # what a ring context-parallel case on the stand-ins must have called
CALLS: List[str] = []  # names of the stand-ins called since install (cleared by install)


def _counted(name: str, fn: Callable) -> Callable:
    def call(*args, **kwargs):
        CALLS.append(name)
        return fn(*args, **kwargs)

    call.__wrapped__ = fn
    return call


def _counted_primitive(name: str, cls) -> Callable:
    """A primitive class whose instances count their calls under ``name``."""
    def make(*args, **kwargs):
        return _counted(name, cls(*args, **kwargs))

    return make


def install_ascend_stand_ins(float32: bool = True) -> Callable[[], None]:
    """Switch this process to the Ascend path with stand-ins; returns the function that undoes it."""
    from mm_parallel import comm
    from mm_parallel.comm.native import NativeBackend
    from mm_parallel.ops import device

    attention_module = importlib.import_module("mm_parallel.ops.attention")  # the package exports the function

    saved = []

    def patch(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    CALLS.clear()
    for name in KERNELS:
        patch(ms_ops, name, _counted(name, getattr(ascend_kernels, name)))
    patch(auto_generate, "grouped_matmul", _counted("grouped_matmul", ascend_kernels.grouped_matmul))
    for name in PRIMITIVES:
        patch(auto_generate, name, _counted_primitive(name, getattr(ascend_kernels, name)))
    calls = types.SimpleNamespace(**{name: getattr(hccl, name) if name in ("P2POp", "isend", "irecv")
                                     else _counted(name, getattr(hccl, name)) for name in hccl.NAMES})
    patch(comm, "_BACKEND", NativeBackend(calls))
    if float32:
        patch(attention_module, "FLASH_ATTENTION_DTYPES", attention_module.FLASH_ATTENTION_DTYPES + [ms.float32])
    ascend_kernels.allow_float32(float32)
    device.set_kernels("fused")

    def undo():
        device.set_kernels(None)
        ascend_kernels.allow_float32(False)
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)

    return undo


@contextlib.contextmanager
def ascend_stand_ins(float32: bool = True):
    """`install_ascend_stand_ins` for the duration of a with block."""
    undo = install_ascend_stand_ins(float32)
    try:
        yield CALLS
    finally:
        undo()


def on_stand_ins(cases: dict, names, prefix: str = "ascend_", bf16_tolerance: Optional[dict] = None) -> dict:
    """The named cases again, each run on the Ascend path's stand-ins (`prefix` + name): what a
    layout-equivalence test adds to cover the fused kernels and the native backend. With
    ``bf16_tolerance`` (equivalence.BF16_TOLERANCE) the case trains in bf16, the stand-ins taking
    bf16 operands only (no float32 widening, as on Ascend), against the bf16 single process."""
    if bf16_tolerance is None:
        return {prefix + name: dict(cases[name], device="ascend_stand_ins") for name in names}
    return {prefix + name: dict(cases[name], device="ascend_stand_ins", precision="bf16", stand_ins_float32=False,
                                tolerance=bf16_tolerance) for name in names}


# the HCCL calls the native backend makes in training layouts (tp + sp, Ulysses, Ring, pp, ZeRO)
HCCL_CALLS = {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
              "batch_isend_irecv"}


def check_stand_in_calls(results, cases: dict, kernels) -> set:
    """Assert every stand-in case went through ``kernels``; returns the calls the cases made together."""
    made = calls_made(results, cases)
    for name, calls in made.items():
        assert set(kernels) <= set(calls), (name, calls)
    return set().union(*made.values())


def calls_made(results, cases: dict) -> dict:
    """{case: the Ascend calls its ranks made together} for the cases run on the stand-ins."""
    made = {}
    for name, case in cases.items():
        if case.get("device") == "ascend_stand_ins":
            made[name] = sorted(set().union(*(set(r.get(f"{name}:stand_ins", ())) for r in results)))
    return made
