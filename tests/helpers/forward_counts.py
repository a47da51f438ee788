"""Counting forwards: proof that a recomputed cell really runs again in the backward.

Equal results alone cannot tell recomputation from none (recomputing changes no number); a
recomputed cell's ``construct`` runs twice per forward + backward, a kept one's once.
"""

import types
from contextlib import contextmanager
from typing import Dict, Sequence


@contextmanager
def counted_forwards(cells: Sequence) -> Dict[int, int]:
    """{index in ``cells``: times its construct ran} while the context is open."""
    counts = {i: 0 for i in range(len(cells))}
    for i, cell in enumerate(cells):
        real = cell.construct

        def counted(self, *args, _real=real, _i=i, **kwargs):
            counts[_i] += 1
            return _real(*args, **kwargs)

        # a bound method, as MindSpore's recompute wrapper accepts only those
        object.__setattr__(cell, "construct", types.MethodType(counted, cell))
    try:
        yield counts
    finally:
        for cell in cells:  # a recompute wrapper made meanwhile keeps counting; nothing reads it
            object.__delattr__(cell, "construct")
