"""The doctor's kernel checks: each fused kernel against the reference path, forward and backward.

On Ascend the fused kernels are the device's; on CPU, which has none, the same checks run the
fused branches against mm_parallel.testing's documented-semantics stand-ins (so this code is
exercised where it is tested). bf16 needs bf16 arithmetic, which the CPU lacks (DESIGN §4): those
rows are skipped there, with the reason.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from typing import Callable, Dict, List, Tuple

import numpy as np

# Deferred imports: MindSpore and mm-parallel (the CLI starts without loading MindSpore).

# max |fused - reference| / max |reference| over the output and every input gradient
TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2}


def _cases() -> List[Tuple[str, Callable, List[tuple], str]]:
    """(name, fn, input shapes, the stand-in call it reaches)."""
    from mindspore import Tensor

    from mm_parallel import ops as kernels

    keep = np.ones((2, 8), np.int32)
    keep[0, :3] = 0
    segments = np.array([[0, 0, 0, 1, 1, 2, 2, 2]], np.int32)
    cos = Tensor(np.cos(np.arange(8 * 16).reshape(8, 16) / 7.0).astype(np.float32))
    sin = Tensor(np.sin(np.arange(8 * 16).reshape(8, 16) / 7.0).astype(np.float32))
    qkv = [(2, 8, 4, 16), (2, 8, 2, 16), (2, 8, 2, 16)]
    return [
        ("flash attention, causal", lambda q, k, v: kernels.attention(q, k, v, causal=True), qkv,
         "flash_attention_score"),
        ("flash attention, key padding", lambda q, k, v: kernels.attention(
            q, k, v, causal=True, key_padding_mask=Tensor(keep)), qkv, "flash_attention_score"),
        ("flash attention, packed (TND)", lambda q, k, v: kernels.attention(
            q, k, v, segment_ids=Tensor(segments)), [(1, 8, 4, 16), (1, 8, 2, 16), (1, 8, 2, 16)],
         "flash_attention_score"),
        ("rms_norm", lambda x, w: kernels.rms_norm(x, w, 1e-6), [(2, 8, 32), (32,)], "rms_norm"),
        ("rotary, half-split", lambda x: kernels.apply_rotary(x, cos.astype(x.dtype), sin.astype(x.dtype)),
         [(2, 8, 4, 16)], "rotary_position_embedding"),
        ("rotary, interleaved", lambda x: kernels.apply_rotary(x, cos.astype(x.dtype), sin.astype(x.dtype), True),
         [(2, 8, 4, 16)], "rotary_position_embedding"),
        ("swiglu", lambda g, u: kernels.swiglu(g, u), [(2, 8, 32), (2, 8, 32)], "swiglu"),
        ("grouped_matmul", lambda x, w: kernels.grouped_matmul(x, w, np.array([3, 0, 5])), [(8, 16), (3, 12, 16)],
         "grouped_matmul"),
    ]


def _grouped_reference(x, w):
    """Rows [0, 3) times w[0]^T, [3, 8) times w[2]^T: grouped_matmul's definition (it has no
    reference path of its own: elsewhere the experts batch their padded groups)."""
    from mindspore import ops

    return ops.concat([ops.matmul(x[:3], w[0].T), ops.matmul(x[3:], w[2].T)], 0)


def max_rel_error(got, want) -> float:
    """max |got - want| / max |want| over pairs of arrays (the output, then each gradient)."""
    return max(float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-30)) for g, w in zip(got, want))


def run_with_gradients(fn, inputs):
    """The output and the gradients of sum(output * fixed weights) with respect to every input."""
    import mindspore as ms
    from mindspore import Tensor

    out = fn(*inputs)
    weights = Tensor(np.random.default_rng(1).standard_normal(out.shape).astype(np.float32)).astype(out.dtype)
    grads = ms.grad(lambda *xs: (fn(*xs) * weights).astype(ms.float32).sum(), tuple(range(len(inputs))))(*inputs)
    return [t.astype(ms.float32).asnumpy() for t in [out] + list(grads)]


def fused_path(on_ascend: bool):
    from mm_parallel.ops import device

    if not on_ascend:
        # The one production import of mm_parallel.testing (tests/contracts/test_imports.py allows it):
        # a CPU has no fused kernels, so the doctor checks the fused branches against the stand-ins.
        # Deferred: only this check on a CPU machine loads them.
        from mm_parallel.testing.device_path import ascend_stand_ins

        return ascend_stand_ins()

    @contextlib.contextmanager
    def fused():
        device.set_kernels("fused")
        try:
            yield []
        finally:
            device.set_kernels(None)

    return fused()


@contextlib.contextmanager
def reference_path():
    """The reference kernels for the duration of a with block, on any device."""
    from mm_parallel.ops import device

    device.set_kernels("reference")
    try:
        yield
    finally:
        device.set_kernels(None)


def compare_paths(fn, shapes, call, dtype, on_ascend) -> Dict:
    """fn on random inputs of ``shapes`` in ``dtype`` ("fp32" / "bf16"), output and input
    gradients, on the fused path (which must reach ``call``) against the reference path:
    {"ok", "seconds", "detail"}."""
    import mindspore as ms
    from mindspore import Tensor

    rng = np.random.default_rng(0)
    ms_dtype = ms.float32 if dtype == "fp32" else ms.bfloat16
    inputs = [Tensor(rng.standard_normal(s).astype(np.float32)).astype(ms_dtype) for s in shapes]
    start = time.perf_counter()
    try:
        with reference_path():
            want = run_with_gradients(_grouped_reference if call == "grouped_matmul" else fn, inputs)
        with fused_path(on_ascend) as calls:
            got = run_with_gradients(fn, inputs)
            if not on_ascend and call not in calls:
                raise AssertionError(f"the fused branch did not call {call}")
        error = max_rel_error(got, want)
        ok = error <= TOLERANCE[dtype]
        detail = f"max rel error {error:.1e} (limit {TOLERANCE[dtype]:g}), output and {len(got) - 1} gradients"
    except Exception:  # noqa: BLE001 - reported per check
        ok, detail = False, traceback.format_exc(limit=4)
    return {"ok": ok, "seconds": round(time.perf_counter() - start, 4), "detail": detail}


def check_kernels(on_ascend: bool) -> List[dict]:
    """One row per kernel case and dtype: {"check", "status", "seconds", "detail"}."""
    rows = []
    for name, fn, shapes, call in _cases():
        for dtype in ("fp32", "bf16"):
            check = f"kernel {name} ({dtype})"
            if dtype == "bf16" and not on_ascend:
                rows.append({"check": check, "status": "skip", "seconds": 0.0,
                             "detail": "the CPU has no bf16 arithmetic kernels: checked on Ascend"})
                continue
            if dtype == "fp32" and name.startswith("flash") and on_ascend:
                rows.append({"check": check, "status": "skip", "seconds": 0.0,
                             "detail": "flash_attention_score takes float16 / bfloat16 only: fp32 attention runs "
                                       "the reference path"})
                continue
            result = compare_paths(fn, shapes, call, dtype, on_ascend)
            rows.append({"check": check, "status": "pass" if result["ok"] else "fail",
                         "seconds": result["seconds"], "detail": result["detail"]})
    return rows
