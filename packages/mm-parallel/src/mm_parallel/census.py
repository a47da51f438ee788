"""Parameters without values: build a model under any rank's layout to learn what that rank holds.

Planning a cluster run (``mm-train plan``) needs, for every model-parallel position (tp rank x pp
stage x ep rank), the parameters that position holds: their shapes after the tp / ep split, their
dtypes after mixed precision, which are trained and which group reduces their gradients. The
surest count is the model code itself, so the planner builds each position's chunks exactly as a
training run does (`Topology.build` gives any rank's topology without communication) but inside
`shapes_only`, where every parameter is created without memory: a 72B model's stage is built in
about a second and holds no bytes.

Every parameter of the model packages is created through `parameter` (tensor_parallel's
``new_parameter``, the norms, experts, routers and LoRA adapters call it); outside `shapes_only`
it is ``Parameter(Tensor(value()))``. Inside, it is a MindSpore tensor declared by shape, dtype
and initializer, whose memory is allocated only when its data is first read (nothing reads it),
and MindSpore's own layers skip their initialisation (``no_init_parameters``).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence, Tuple

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn

_shapes_only = False


@contextlib.contextmanager
def shapes_only():
    """Within: parameters are created by shape only (no memory, no random draws)."""
    from mindspore.nn.utils import no_init_parameters

    global _shapes_only
    before, _shapes_only = _shapes_only, True
    try:
        with no_init_parameters():
            yield
    finally:
        _shapes_only = before


def parameter(shape: Sequence[int], name: str, value: Callable[[], np.ndarray], requires_grad: bool = True):
    """A float32 parameter of ``shape`` holding ``value()`` (called only when values are made)."""
    if _shapes_only:
        from mindspore.common.initializer import Zero

        return Parameter(Tensor(shape=tuple(int(d) for d in shape), dtype=ms.float32, init=Zero()), name=name,
                         requires_grad=requires_grad)
    array = np.ascontiguousarray(value(), np.float32)
    if tuple(array.shape) != tuple(shape):
        raise ValueError(f"parameter {name}: value of shape {array.shape}, declared {tuple(shape)}")
    return Parameter(Tensor(array), name=name, requires_grad=requires_grad)


def filled(shape: Sequence[int], name: str, fill: float, requires_grad: bool = True):
    """A float32 parameter of ``shape`` with every value ``fill`` (norm weights 1, biases 0)."""
    return parameter(shape, name, lambda: np.full(tuple(shape), fill, np.float32), requires_grad)


def owned_parameters(model: nn.Cell) -> Iterator[Tuple[str, Parameter, nn.Cell, str]]:
    """(path name, parameter, owning cell, attribute) for every parameter, each once (tied ones too)."""
    seen = set()
    for prefix, cell in model.cells_and_names():
        for attr, param in cell._params.items():
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            yield (f"{prefix}.{attr}" if prefix else attr), param, cell, attr
