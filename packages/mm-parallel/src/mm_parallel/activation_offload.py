"""Activation offload: the tensors autograd saves for the backward kept in host memory.

In the forward, each tensor MindSpore's autograd saves for the backward (a layer's inputs, its
intermediate results) of at least ``min_numel`` values is copied to host memory and dropped from
the device; the backward copies it back when it needs it. Parameters stay where they are (the
weights are already held), and so do small tensors (the copy would cost more than it saves).
Built on MindSpore's saved-tensor hooks (``mindspore.saved_tensors_hooks``, PyNative only), the
mechanism of torch's ``save_on_cpu``: the values are the same, bit for bit; the device memory of
the activations becomes host memory, and the step pays two copies of them (device to host in
the forward, back in the backward).

Recomputed layers keep no activations but their inputs: offload then moves those. A custom
backward (`mm_parallel.mappings`' regions, ZeRO-3's) receives its inputs from autograd and is
covered too.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor

DEFAULT_MIN_NUMEL = 2 ** 14


class _OnHost:
    """A saved tensor's values in host memory (bfloat16 kept as float32: exact)."""

    __slots__ = ("values", "dtype")

    def __init__(self, values: np.ndarray, dtype):
        self.values, self.dtype = values, dtype


class ActivationOffload:
    """``with ActivationOffload().saving():`` around a forward (and its backward's set-up) puts
    its saved tensors in host memory. ``offloaded_bytes``: device bytes moved so far."""

    def __init__(self, min_numel: int = DEFAULT_MIN_NUMEL):
        self.min_numel, self.offloaded_bytes = min_numel, 0

    def pack(self, tensor):
        if isinstance(tensor, Parameter) or not isinstance(tensor, Tensor) or tensor.size < self.min_numel:
            return tensor
        self.offloaded_bytes += tensor.nbytes
        host = tensor.astype(ms.float32) if tensor.dtype == ms.bfloat16 else tensor
        return _OnHost(host.asnumpy().copy(), tensor.dtype)

    @staticmethod
    def unpack(packed):
        if not isinstance(packed, _OnHost):
            return packed
        back = Tensor(packed.values)
        return back.astype(packed.dtype) if packed.dtype == ms.bfloat16 else back

    def saving(self):
        """The context in whose forward saved tensors go to host memory."""
        return ms.saved_tensors_hooks(self.pack, self.unpack)
