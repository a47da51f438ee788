"""Tensor-parallel equivalence, run inside msrun workers: a tiny LM block under tp (with and without
sequence parallel) against the same block in a world of one on the same full weights."""

from __future__ import annotations

import traceback

import numpy as np

V, H, F, B, S = 16, 8, 16, 2, 8


def full_weights():
    rng = np.random.default_rng(7)
    return {
        "emb.weight": rng.normal(0, 0.5, (V, H)),
        "up.weight": rng.normal(0, 0.5, (F, H)),
        "up.bias": rng.normal(0, 0.1, (F,)),
        "down.weight": rng.normal(0, 0.5, (H, F)),
        "down.bias": rng.normal(0, 0.1, (H,)),
        "norm_weight": 1 + rng.normal(0, 0.1, (H,)),
        "head.weight": rng.normal(0, 0.5, (V, H)),
    }


def batch():
    rng = np.random.default_rng(11)
    ids = rng.integers(0, V, (B, S)).astype(np.int32)
    labels = rng.integers(0, V, (B, S)).astype(np.int32)
    labels[0, :2] = -100  # ignored positions
    return ids, labels


def build(topology, sequence_parallel, split_io):
    """emb -> (+ MLP) -> rms_norm -> lm head -> vocab-parallel CE. split_io uses gather_output /
    input_is_parallel=False between the MLP's two linears instead of the direct hand-off."""
    from mindspore import Parameter, Tensor, nn

    from mm_parallel import ops as K
    from mm_parallel.sequence_parallel import mark_sequence_parallel
    from mm_parallel.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        vocab_parallel_cross_entropy,
    )

    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            sp = dict(topology=topology, sequence_parallel=sequence_parallel)
            self.emb = VocabParallelEmbedding(V, H, **sp)
            self.up = ColumnParallelLinear(H, F, gather_output=split_io, **sp)
            self.down = RowParallelLinear(F, H, input_is_parallel=not split_io, **sp)
            self.norm_weight = Parameter(Tensor(np.ones(H, np.float32)), name="norm_weight")
            if sequence_parallel:
                mark_sequence_parallel(self.norm_weight)
            self.head = ColumnParallelLinear(H, V, bias=False, **sp)
            self.group = topology.tp

        def construct(self, ids, labels):
            h = self.emb(ids)
            h = h + self.down(K.gelu(self.up(h)))
            h = K.rms_norm(h, self.norm_weight)
            return vocab_parallel_cross_entropy(self.head(h), labels, self.group)

    block = Block()
    weights = full_weights()
    for layer in ("emb", "up", "down", "head"):
        cell = getattr(block, layer)
        cell.load_full(**{k.split(".")[1]: v for k, v in weights.items() if k.startswith(layer + ".")})
    block.norm_weight.set_data(Tensor(weights["norm_weight"].astype(np.float32)))
    return block


def loss_and_full_grads(block, topology):
    """Loss and every parameter's gradient, tp shards gathered to full, SP grads synchronised."""
    from helpers.reference_model import full_arrays, local_loss_and_grads
    from mindspore import Tensor

    ids, labels = batch()
    params = block.trainable_params()
    loss, grads = local_loss_and_grads(block, params, topology, Tensor(ids), Tensor(labels))
    return float(loss.asnumpy()), full_arrays(block, topology, params, grads)


def run_tp_cases(tp: int):
    import mindspore as ms

    import mm_parallel
    from mm_parallel import ParallelConfig
    from mm_parallel.topology import Topology

    ms.set_seed(0)
    results = {}
    solo = Topology.build(ParallelConfig(), 1, 0)
    for sp in (False, True):
        for split_io in (False, True):
            if sp and split_io:
                continue  # sequence parallel hands the MLP over split on features only
            name = f"tp{tp}{'_sp' if sp else ''}{'_gather_scatter' if split_io else ''}"
            try:
                topo = mm_parallel.initialize(ParallelConfig(tp=tp, sequence_parallel=sp))
                ref_loss, ref_grads = loss_and_full_grads(build(solo, False, split_io), solo)
                loss, grads = loss_and_full_grads(build(topo, sp, split_io), topo)
                problems = []
                if not np.isclose(loss, ref_loss, rtol=1e-5, atol=0):
                    problems.append(f"loss {loss} != {ref_loss}")
                for key, want in ref_grads.items():
                    got = grads[key]
                    if got.shape != want.shape or not np.allclose(got, want, rtol=1e-4, atol=1e-6):
                        err = np.abs(got - want).max() if got.shape == want.shape else (got.shape, want.shape)
                        problems.append(f"grad {key}: max abs err {err}")
                results[name] = {"problems": problems, "loss": loss, "ref_loss": ref_loss}
            except Exception:
                results[name] = {"problems": [traceback.format_exc()], "loss": None, "ref_loss": None}
    return results
