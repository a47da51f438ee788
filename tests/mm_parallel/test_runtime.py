"""Custom-bprop Cells get their bprop called on every backward once mm_parallel is imported
(MindSpore 2.7.2 skips some under asynchronous launch: see mm_parallel.runtime)."""

import subprocess
import sys

import pytest

from mm_parallel import runtime

# Four identity Cells whose bprop doubles the gradient, 300 steps: with asynchronous launch 13-36
# steps came out wrong (measured); each step here must equal the numpy gradient.
LOOP = """
import numpy as np
import mm_parallel  # first: before any op runs
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

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
wrong = [i for i in range(300) if not np.allclose(grad(Tensor(x0)).asnumpy(), want, rtol=1e-5)]
print("wrong", len(wrong), "calls", len(calls))
"""


def test_custom_bprop_runs_on_every_step():
    out = subprocess.run([sys.executable, "-c", LOOP], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-4:] == ["wrong", "0", "calls", "1200"], out.stdout


def test_blocking_launch_choice(monkeypatch):
    monkeypatch.delenv("MM_LAUNCH_BLOCKING", raising=False)
    assert runtime.wants_blocking_launch()  # CPU
    monkeypatch.setenv("MM_LAUNCH_BLOCKING", "0")
    assert not runtime.wants_blocking_launch()
    monkeypatch.setenv("MM_LAUNCH_BLOCKING", "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        runtime.wants_blocking_launch()
