"""Mixed precision with Megatron's semantics: bf16 / fp16 parameters and activations, fp32 where it counts.

    parameters      in the compute dtype, except the modules a model keeps in fp32 (its
                    ``_keep_in_fp32_modules``, named as transformers / diffusers name them) and
                    parameters marked with `keep_in_fp32` (LoRA adapters, as PEFT keeps them;
                    MoE expert biases, updated by tiny steps)
    master weights  fp32, with both Adam moments, in the DistributedOptimizer (ZeRO shards them)
    gradients       per micro-batch in the parameter's dtype (what autodiff returns), accumulated
                    over the step's micro-batches in ``grad_dtype`` (fp32: Megatron's main_grad)
    kept in fp32    norm statistics, softmax and attention lse, rotary tables, router logits,
                    losses: the kernel layer computes them in fp32 whatever its inputs
    fp16            dynamic loss scaling (the optimizer skips a step whose gradients overflow and
                    halves the scale; it doubles after loss_scale_window clean steps)

Bytes per parameter a rank holds: 2 (bf16 weight) + 4 (fp32 accumulated gradient; 2 with
grad_dtype bf16) + 12 / D (fp32 master, exp_avg, exp_avg_sq over the D ranks ZeRO shards them
over; D = 1 without ZeRO).

The kernels compute in the low dtype on Ascend and emulate it on CPU (mm_parallel.ops.low_precision).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

import mindspore as ms

from mm_parallel import zero3
from mm_parallel.census import owned_parameters
from mm_parallel.ops import low_precision

DTYPES = {"fp32": ms.float32, "bf16": ms.bfloat16, "fp16": ms.float16}
TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # config.json's "dtype"


def dtype_named(name: str):
    """The MindSpore dtype of ``fp32`` / ``bf16`` / ``fp16`` (or the torch names float32 / bfloat16 / float16)."""
    short = {v: k for k, v in TORCH_NAMES.items()}.get(name, name)
    if short not in DTYPES:
        raise ValueError(f"unknown precision {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[short]


@dataclass(frozen=True)
class Precision:
    """``name``: the parameters' and activations' dtype; ``grad_dtype``: what the gradients of a
    step's micro-batches are summed in."""

    name: str = "fp32"
    grad_dtype: str = "fp32"

    def __post_init__(self):
        dtype_named(self.name)
        if self.grad_dtype not in ("fp32", self.name):
            raise ValueError(f"grad_dtype {self.grad_dtype!r} must be fp32 or the precision itself ({self.name})")

    @property
    def param_dtype(self):
        return DTYPES[self.name]

    @property
    def accumulate_dtype(self):
        return DTYPES[self.grad_dtype]

    @property
    def torch_name(self) -> str:
        return TORCH_NAMES[self.name]

    def optimizer_config(self, config):
        """The optimizer config this precision needs: fp16 without a static loss_scale gets dynamic
        loss scaling (Megatron's default); others are returned as they are."""
        if self.name == "fp16" and not config.loss_scale and not config.dynamic_loss_scale:
            return replace(config, dynamic_loss_scale=True)
        return config


def activate(precision: Precision) -> None:
    """Make ``precision`` the process's policy: the dtype weight-free kernels (attention) compute in."""
    low_precision.set_compute_dtype(precision.param_dtype)


def torch_name(dtype) -> str:
    """The torch name (config.json's "dtype") of a MindSpore float dtype; float32 for any other."""
    return next((TORCH_NAMES[short] for short, d in DTYPES.items() if d == dtype), "float32")


def _kept(name: str, keep: Sequence[str]) -> bool:
    """transformers' rule for ``_keep_in_fp32_modules``: a module name among the path's parts."""
    parts = name.split(".")
    return any(module in parts or name.startswith(module + ".") for module in keep)


def keep_in_fp32(*params):
    """Mark parameters that stay float32 whatever the precision; returns the first."""
    for param in params:
        param.keep_in_fp32 = True
    return params[0] if params else None


def cast_parameters(model, precision: Precision, keep_in_fp32: Iterable[str] = ()) -> int:
    """Cast ``model``'s floating parameters (frozen ones too) to the precision's dtype in place,
    except those under ``keep_in_fp32`` modules and those marked by `keep_in_fp32`; returns how
    many were cast."""
    keep, cast = tuple(keep_in_fp32 or ()), 0
    if precision.param_dtype == ms.float32:
        return 0
    for name, param, _, _ in owned_parameters(model):
        dtype = dtype_under(precision, name, param, keep)
        if param.dtype != dtype:
            param.set_dtype(dtype)
            cast += 1
    return cast


def dtype_under(precision: Precision, name: str, param, keep_in_fp32: Sequence[str] = ()):
    """The dtype `cast_parameters` gives parameter ``name``: the precision's, unless it is not a
    float of ours, is marked `keep_in_fp32`, or lies under a ``keep_in_fp32`` module."""
    if getattr(param, "keep_in_fp32", False) or param.dtype not in DTYPES.values() or _kept(name, keep_in_fp32):
        return param.dtype
    return precision.param_dtype


def parameter_bytes(params) -> int:
    """Bytes the given parameters hold (their own dtypes)."""
    return sum(int(p.nbytes) for p in params)


def apply(model, precision: Precision) -> int:
    """The trainer's entry: make ``precision`` active and cast ``model`` (a model chunk) to it,
    keeping the modules its class lists in ``_keep_in_fp32_modules`` (transformers' / diffusers'
    attribute) in fp32; returns how many parameters were cast."""
    activate(precision)
    return cast_parameters(model, precision, getattr(type(model), "_keep_in_fp32_modules", None) or ())


def dominant_dtype_name(params) -> str:
    """The torch name of the dtype most of ``params``' values are in (what config.json records)."""
    counts = {}
    for p in params:
        dtype = zero3.value_dtype(p)  # a ZeRO-3 slice is float32 storage of its layer's dtype
        counts[dtype] = counts.get(dtype, 0) + math.prod(zero3.value_shape(p))
    return torch_name(max(counts, key=counts.get)) if counts else "float32"
