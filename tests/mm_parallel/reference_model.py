"""A small reference transformer for parallel-equivalence tests: pre-norm blocks of attention
(separate q/k/v column-parallel projections, CoreAttention, row-parallel output) and a GELU MLP.
causal=True is the language-model stack, causal=False the bidirectional DiT-like one."""

from __future__ import annotations

import numpy as np

H, HEADS, F = 16, 4, 32


def build_stack(topology, layers=3, causal=True, seed=3):
    from mindspore import Parameter, Tensor, nn

    from mm_parallel import ops as K
    from mm_parallel.recompute import CoreAttention
    from mm_parallel.sequence_parallel import mark_sequence_parallel
    from mm_parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    sp = topology.config.sequence_parallel
    rng = np.random.default_rng(seed)

    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            kw = dict(topology=topology)
            self.q, self.k, self.v = (ColumnParallelLinear(H, H, **kw) for _ in range(3))
            self.core = CoreAttention(causal=causal, topology=topology)
            self.o = RowParallelLinear(H, H, **kw)
            self.up = ColumnParallelLinear(H, F, **kw)
            self.down = RowParallelLinear(F, H, **kw)
            self.norm1 = Parameter(Tensor(np.ones(H, np.float32)), name="norm1")
            self.norm2 = Parameter(Tensor(np.ones(H, np.float32)), name="norm2")
            if sp:
                mark_sequence_parallel(self.norm1, self.norm2)
            for name in ("q", "k", "v", "o", "up", "down"):
                cell = getattr(self, name)
                out_f, in_f = (cell.weight.shape[0] * (topology.tp.size if name in "qkv up" else 1),
                               cell.weight.shape[1] * (topology.tp.size if name in ("o", "down") else 1))
                cell.load_full(weight=rng.normal(0, in_f ** -0.5, (out_f, in_f)), bias=rng.normal(0, 0.1, (out_f,)))

        def construct(self, x):
            h = K.rms_norm(x, self.norm1)
            b, s = h.shape[0], None
            q, k, v = self.q(h), self.k(h), self.v(h)
            s = q.shape[1]
            q, k, v = (t.reshape(b, s, -1, H // HEADS) for t in (q, k, v))
            a = self.core(q, k, v)
            x = x + self.o(a.reshape(b, s, -1))
            return x + self.down(K.gelu(self.up(K.rms_norm(x, self.norm2))))

    return nn.CellList([Block() for _ in range(layers)])


def run_stack(stack, x):
    for block in stack:
        x = block(x)
    return x
