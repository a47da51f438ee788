"""Which kernels to use: fused Ascend kernels on Ascend, the CPU reference path elsewhere.

``MM_KERNELS=reference`` forces the reference path on any device (to compare the two on Ascend).
"""

import os

import mindspore as ms
from mindspore import ops


def use_fused() -> bool:
    if os.environ.get("MM_KERNELS") == "reference":
        return False
    return ms.get_context("device_target") == "Ascend"


def tiled_to(x, shape):
    """``x`` repeated up to ``shape`` along its size-one dims.

    MindSpore's CPU kernels run broadcasting elementwise ops ~10x slower than same-shape ones
    (measured on 8M floats: 95 ms against 9 ms) while tile is cheap, so the reference path tiles
    masks, row statistics and rotary tables before combining them with big tensors.
    """
    return ops.tile(x, tuple(n // m for n, m in zip(shape, x.shape)))
