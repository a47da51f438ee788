"""ZeRO-3 prefetch: the next weight's gather begun before the current layer computes.

A step uses the sharded weights in the same order every time (the model, the schedule of
micro-batches, recomputation and pipeline chunks do not change between steps). `Prefetcher`
records the order of the uses of one step — (region, phase) as `mm_parallel.zero3`'s regions
gather their weights — and, in the next step, right after use i has its weight, begins the
gather of use i + 1's: an asynchronous collective on the device path (HCCL's async_op,
`mm_parallel.comm.all_gather_start`), waited on where that weight is used. The transfer then runs
while layer i computes (FSDP's forward and backward prefetch, from the recorded order as FSDP2
does). At most two whole weights are held: the one in use and the next. When the next use is
the same weight's (the last layer's forward, then its backward) the weight is kept for it
instead of gathered again (FSDP leaves the last layer unsharded after its forward likewise).

Only where the backend's collectives are asynchronous (`Backend.asynchronous`: the native one);
on the CPU backend a collective completes in the call, so beginning it earlier overlaps nothing
and would hold two weights for nothing. A step whose uses leave the recorded order (the first
step; a different number of micro-batches) prefetches nothing from that point on, and the gathers
it begun for uses that did not come are waited on and dropped at the step's end (`step_done`).
The gathers per step are those zero3's module docstring counts, less one for each weight kept.
"""

from __future__ import annotations

import collections
from typing import Dict, List, Tuple

from mm_parallel import comm

# "forward" / "backward": gathers begun ahead; "reused": weights kept for their next use
PREFETCHED: collections.Counter = collections.Counter()


class Prefetcher:
    """See the module docstring."""

    def __init__(self):
        self.last: List[Tuple[object, str]] = []  # the previous step's uses
        self.now: List[Tuple[object, str]] = []  # this step's so far
        self.pending: Dict[int, object] = {}  # id(region) -> its begun gather (a Pending)

    def take(self, region):
        """The region's weight if its gather was begun ahead (waited on here), else None."""
        pending = self.pending.pop(id(region), None)
        return None if pending is None else pending.wait()

    def used(self, region, phase: str, weight) -> None:
        """Note the use of ``weight``; if the step follows the last one's order, begin the next
        use's gather — or, when the next use is this region's again (the last layer's forward,
        then its backward), keep ``weight`` for it: no gather at all."""
        self.now.append((region, phase))
        at = len(self.now)
        if not comm.get_backend().asynchronous or at >= len(self.last):
            return
        if self.last[at - 1][0] is not region:  # this step left the recorded order: no guessing
            self.last = []
            return
        following, its_phase = self.last[at]
        if id(following) in self.pending or following.kept is not None:
            return
        if following is region:
            self.pending[id(region)] = comm.Pending(lambda: weight)
            PREFETCHED["reused"] += 1
        else:
            self.pending[id(following)] = following.begin(its_phase)
            PREFETCHED[its_phase] += 1

    def step_done(self) -> None:
        """The step's end (before the optimizer changes the weights): gathers begun for uses that
        did not come are finished and dropped; this step's order is the next one's guide."""
        for pending in self.pending.values():
            pending.wait()
        self.pending.clear()
        self.last, self.now = self.now, []


PREFETCH = Prefetcher()
