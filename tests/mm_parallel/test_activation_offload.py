"""mm_parallel.activation_offload: with the saved tensors in host memory between forward and
backward, a stack's loss and gradients are those without, bit for bit — fp32 and bf16, kept
activations and full recomputation — and only tensors of at least min_numel values, never
parameters, are moved."""

import numpy as np
import pytest


@pytest.mark.parametrize("precision_name", ["fp32", "bf16"])
@pytest.mark.parametrize("recomputed", [False, True])
def test_offloaded_activations_give_the_same_gradients(precision_name, recomputed):
    import mindspore as ms
    from helpers.reference_model import build_stack, run_stack
    from mindspore import Tensor

    from mm_parallel import precision
    from mm_parallel.activation_offload import ActivationOffload
    from mm_parallel.config import ParallelConfig
    from mm_parallel.ops.device import as_type
    from mm_parallel.topology import Topology

    topo = Topology.build(ParallelConfig(), 1, 0)
    try:
        stack = build_stack(topo)
        precision.apply(stack, precision.Precision(precision_name))
        if recomputed:
            for block in stack:
                block.recompute()
        params = stack.trainable_params()
        x = Tensor(np.random.default_rng(0).standard_normal((2, 8, 16)).astype(np.float32))
        grad = ms.value_and_grad(lambda t: as_type(run_stack(stack, t), ms.float32).sum(), None, params)
        loss, grads = grad(x)
        offload = ActivationOffload(min_numel=64)
        packed = []
        original = offload.pack
        offload.pack = lambda t: packed.append(t) or original(t)
        with offload.saving():
            loss_off, grads_off = grad(x)
    finally:
        precision.activate(precision.Precision())
    assert float(loss.asnumpy()) == float(loss_off.asnumpy())
    for a, b in zip(grads, grads_off):
        assert np.array_equal(as_type(a, ms.float32).asnumpy(), as_type(b, ms.float32).asnumpy())
    moved = [t for t in packed if not isinstance(t, ms.Parameter) and t.size >= 64]
    assert moved and offload.offloaded_bytes == sum(t.nbytes for t in moved)
