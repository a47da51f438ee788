"""The cases that run a whole model on the Ascend path's stand-ins in one process, without launching."""

from mm_parallel.testing.device_path import on_stand_ins
from mm_parallel.testing.equivalence import BF16_TOLERANCE

FP32 = {"loss_rtol": 1e-5, "rel": 1e-5, "param_rel": 1e-4}


def one_process_cases(**checkpoints) -> dict:
    """{name: case} for each ``name=checkpoint sub-folder``: the model on the stand-ins in fp32
    (flash attention widened to float32; loss and gradients rel 1e-5 against the CPU path) and in
    bf16 (no widening: the kernels take bf16 operands, as on Ascend; within BF16_TOLERANCE of the
    bf16 CPU path). Parameters after the two AdamW steps: rel 1e-4, as every layout, since Adam
    divides a tiny gradient by its own size (Omni's patch embedding, measured: gradients within
    1.4e-6, the parameter 2.3e-5)."""
    plain = {name: {"layout": {}, "checkpoint": folder, "tolerance": FP32} for name, folder in checkpoints.items()}
    return {**on_stand_ins(plain, plain), **on_stand_ins(plain, plain, "ascend_bf16_", BF16_TOLERANCE)}
