"""A small reference transformer for parallel-equivalence tests: pre-norm blocks of attention
(separate q/k/v column-parallel projections, CoreAttention, row-parallel output) and a GELU MLP.
causal=True is the language-model stack, causal=False the bidirectional DiT-like one.

Plus what every equivalence test does with it: cut the full batch to this rank's slice, take the
loss and the gradients a layout's optimizer would see, gather shards back to full arrays, and
step a plain AdamW on the local shards."""

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
            # k without bias: its gradient is zero in exact arithmetic (softmax ignores a shift
            # shared by all keys), so an optimizer step would only amplify rounding noise.
            self.q, self.v = ColumnParallelLinear(H, H, **kw), ColumnParallelLinear(H, H, **kw)
            self.k = ColumnParallelLinear(H, H, bias=False, **kw)
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
                weight, bias = rng.normal(0, in_f ** -0.5, (out_f, in_f)), rng.normal(0, 0.1, (out_f,))
                cell.load_full(weight=weight, **({} if cell.bias is None else {"bias": bias}))

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


def local_slice(t, topo):
    """This rank's part of a full (batch, seq, ...) tensor: cp layout, then the SP chunk over tp."""
    from mm_parallel import context_parallel
    from mm_parallel.comm.base import chunk

    t = context_parallel.split_sequence(t, 1, topo)
    if topo.config.sequence_parallel:
        t = chunk(t, topo.tp.size, topo.tp.rank, 1)
    return t


def local_loss_and_grads(loss_fn, params, topo, *inputs):
    """loss_fn(*inputs) and its gradients as an optimizer on this rank must see them: summed over
    cp (each cp rank saw part of the sequence, like data parallel), tp-partial gradients (SP
    norms, LoRA A of column layers) all-reduced over tp."""
    import mindspore as ms

    from mm_parallel import comm
    from mm_parallel.sequence_parallel import sync_sequence_parallel_grads

    loss, grads = ms.value_and_grad(loss_fn, None, params)(*inputs)
    if topo.cp.size > 1:
        loss, grads = comm.all_reduce(loss, topo.cp), [comm.all_reduce(g, topo.cp) for g in grads]
    if topo.tp.size > 1:
        grads = sync_sequence_parallel_grads(params, grads, topo.tp)
    return loss, list(grads)


def full_arrays(model, topo, params, tensors):
    """{parameter name: full numpy array} of per-parameter tensors, tp shards (and ZeRO-3 slices) gathered."""
    from mm_parallel.sharding import sharding_of

    full = {}
    for p, t in zip(params, tensors):
        spec = sharding_of(p)
        full[p.name] = (spec.gather(t, topo) if spec.sharded else t).asnumpy()
    return full


def stack_loss_and_grads(stack, topo, x, c):
    """(loss sum(stack(x) * c), trainable params, their local gradients) on this rank's slices."""
    from mm_parallel import comm

    params = stack.trainable_params()
    loss, grads = local_loss_and_grads(lambda t: (run_stack(stack, t) * c).sum(), params, topo, x)
    if topo.config.sequence_parallel:  # each tp rank summed over its own sequence chunk
        loss = comm.all_reduce(loss, topo.tp)
    return loss, params, grads


def loss_and_grads(stack, topo, x, c):
    """Loss sum(stack(x) * c) and every trainable parameter's full gradient."""
    loss, params, grads = stack_loss_and_grads(stack, topo, x, c)
    return float(loss.asnumpy()), full_arrays(stack, topo, params, grads)


class AdamW:
    """Plain AdamW (bias-corrected, decoupled weight decay) on whatever shards this rank holds:
    elementwise, so a sharded step equals the full step cut to the shard."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        from mindspore import ops

        self.params, self.lr, self.betas, self.eps, self.wd = list(params), lr, betas, eps, weight_decay
        self.m = [ops.zeros_like(p) for p in self.params]
        self.v = [ops.zeros_like(p) for p in self.params]
        self.t = 0

    def step(self, grads):
        b1, b2 = self.betas
        self.t += 1
        for i, (p, g) in enumerate(zip(self.params, grads)):
            self.m[i] = b1 * self.m[i] + (1 - b1) * g
            self.v[i] = b2 * self.v[i] + (1 - b2) * g * g
            m_hat, v_hat = self.m[i] / (1 - b1 ** self.t), self.v[i] / (1 - b2 ** self.t)
            p.set_data(p * (1 - self.lr * self.wd) - self.lr * m_hat / (v_hat.sqrt() + self.eps))
