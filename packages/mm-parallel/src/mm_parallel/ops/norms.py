"""Normalisations: layer_norm and rms_norm, computed in float32 whatever the input dtype."""

import mindspore as ms
from mindspore import ops

from mm_parallel.ops.device import use_fused


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim (biased variance)."""
    dtype = x.dtype
    hidden = x.shape[-1]
    weight = ops.ones((hidden,), ms.float32) if weight is None else weight.astype(ms.float32)
    bias = ops.zeros((hidden,), ms.float32) if bias is None else bias.astype(ms.float32)
    out = ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1, epsilon=eps)(x.astype(ms.float32), weight, bias)[0]
    return out.astype(dtype)


def rms_norm(x, weight=None, eps: float = 1e-6):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim.

    As transformers' Qwen2RMSNorm: normalise in float32, cast back to the input dtype, then scale.
    """
    if use_fused() and weight is not None:
        return ops.rms_norm(x, weight, eps)[0]
    dtype = x.dtype
    h = x.astype(ms.float32)
    h = h * ops.rsqrt(ops.square(h).mean(-1, keep_dims=True) + eps)
    h = h.astype(dtype)
    return h if weight is None else weight * h
