"""Which kernels to use: fused Ascend kernels on Ascend, the CPU reference path elsewhere.

``MM_KERNELS=reference`` forces the reference path on any device (to compare the two on Ascend).
"""

import os

import mindspore as ms


def use_fused() -> bool:
    if os.environ.get("MM_KERNELS") == "reference":
        return False
    return ms.get_context("device_target") == "Ascend"
