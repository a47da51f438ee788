"""The native CPU kernels (mm_parallel.ops.native) against the operator-by-operator path they
replace, side by side in one run.

    python benchmarks/native_kernels.py [--shape 2048 2048] [--runs 9]

For each kernel: forward, and forward + backward, best of ``--runs`` alternating calls, the
written-out path (one MindSpore operator per step of the formula; swiglu: MindSpore's SiLU
times up) and the native one (one C++ pass per direction), their ratios, and the largest
difference between the two outputs and input gradients. The 2048 x 2048 default is a Wan FFN's
hidden activation (2,048 tokens x 2,048 features); the norms run on rows of 512.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def _seconds(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def cases(shape):
    """{kernel: (written-out fn, native fn, inputs)}: each fn maps the inputs to one tensor."""
    from mindspore import Tensor

    from mm_parallel.ops import activations, norms

    rng = np.random.default_rng(0)

    def tensor(*dims):
        return Tensor(rng.standard_normal(dims).astype(np.float32))

    rows, hidden = shape[0], 512  # norms: rows of a model width
    native_standardize = norms._NativeRowNormalise("Standardize", 1e-6)
    native_rms = norms._NativeRowNormalise("RmsScale", 1e-6)
    return {
        f"gelu-tanh {shape[0]} x {shape[1]}": (activations._gelu_tanh, activations._gelu_tanh_on_cpu(),
                                               (tensor(*shape),)),
        f"swiglu {shape[0]} x {shape[1]}": (lambda g, u: activations.ops.silu(g) * u, activations._NativeSwiglu(),
                                            (tensor(*shape), tensor(*shape))),
        f"layer-norm core {rows} x {hidden}": (lambda h: norms._Standardize(1e-6)(h)[0],
                                               lambda h: native_standardize(h)[0], (tensor(rows, hidden),)),
        f"rms-norm core {rows} x {hidden}": (lambda h: norms.rms_scaled(h, 1e-6),
                                             lambda h: native_rms(h)[0], (tensor(rows, hidden),)),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=2, default=[2048, 2048])
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args(argv)
    import mindspore as ms

    import mm_parallel  # noqa: F401  (its launch mode: blocking on CPU)
    from mm_parallel.ops import native

    for name in ("gelu_tanh", "swiglu", "norms"):
        if native.library(name) is None:
            print(f"native {name} unavailable: {native.unavailable_reason(name)}")
            return 1
    print(f"best of {args.runs} (ms); forward + backward = the forward, then the backward of a given cotangent")
    print(f"{'kernel':30} {'written fwd':>11} {'native fwd':>10} {'ratio':>6} {'written f+b':>11} "
          f"{'native f+b':>10} {'ratio':>6} {'max diff':>9}")
    for name, (written, fused, inputs) in cases(args.shape).items():
        cotangent = ms.ops.ones_like(written(*inputs)) * 0.5

        def both(fn):  # forward, then the backward of the cotangent: the kernel's two directions only
            return lambda: ms.vjp(fn, *inputs)[1](cotangent)

        paths = {"written": written, "native": fused}
        results = {path: (fn(*inputs),) + tuple(both(fn)()) for path, fn in paths.items()}
        diff = max(float(np.abs(a.asnumpy() - b.asnumpy()).max()) for a, b in zip(*results.values()))
        times = {(path, part): [] for path in paths for part in ("forward", "both")}
        for _ in range(args.runs):
            for path, fn in paths.items():
                times[(path, "forward")].append(_seconds(lambda fn=fn: fn(*inputs).asnumpy()))
                times[(path, "both")].append(_seconds(lambda fn=fn: [g.asnumpy() for g in both(fn)()]))
        best = {key: 1000 * min(values) for key, values in times.items()}
        print(f"{name:30} {best[('written', 'forward')]:11.2f} {best[('native', 'forward')]:10.2f} "
              f"{best[('native', 'forward')] / best[('written', 'forward')]:6.2f} {best[('written', 'both')]:11.2f} "
              f"{best[('native', 'both')]:10.2f} {best[('native', 'both')] / best[('written', 'both')]:6.2f} "
              f"{diff:9.2g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
