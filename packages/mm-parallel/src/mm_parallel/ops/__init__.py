"""The kernel layer every model calls. The CPU path uses operators with CPU kernels and is the
tested reference; on Ascend, fused kernels (flash_attention_score, rms_norm,
rotary_position_embedding, swiglu, grouped_matmul) are chosen automatically (``MM_KERNELS=reference`` forces the
reference path)."""

from mm_parallel.ops.activations import gelu, silu, swiglu
from mm_parallel.ops.attention import attention, segment_ids_from_cu_seqlens
from mm_parallel.ops.grouped_matmul import grouped_matmul
from mm_parallel.ops.norms import layer_norm, rms_norm
from mm_parallel.ops.rotary import apply_rotary, rotate_half, rotate_interleaved

__all__ = [
    "apply_rotary",
    "attention",
    "gelu",
    "grouped_matmul",
    "layer_norm",
    "rms_norm",
    "rotate_half",
    "rotate_interleaved",
    "segment_ids_from_cu_seqlens",
    "silu",
    "swiglu",
]
