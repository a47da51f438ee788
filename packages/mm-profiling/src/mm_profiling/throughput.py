"""Step throughput (SPS, TPS), MFU and memory, per rank and for the cluster.

    meter = Throughput(flops_per_sample=TRAIN_FACTOR * qwen2_5_vl_flops(cfg, seq, grids),
                       peak_flops=host_peak_flops(), world_size=topo.world_size, dp_size=topo.dp.size)
    stats = meter.record(seconds, samples=4, tokens=1800, padded_tokens=2048)
    stats["samples_per_s"], stats["cluster_tokens_per_s"], stats["mfu"]

Counts are this data-parallel replica's (every tp / cp / pp rank of a replica sees the same
samples); cluster figures multiply by the number of replicas. Tokens are real ones, padded ones
are counted separately. MFU = FLOPs the cluster did in the step / (seconds x peak x world size).
The peak is per device: measured on the host for CPU runs (`host_peak_flops`); on Ascend pass the
device's datasheet figure for the dtype you train in.
"""

from __future__ import annotations

import resource
import time
from typing import Dict, Optional

import numpy as np


def host_peak_flops(size: int = 1024, repeats: int = 5) -> float:
    """float32 matmul FLOP/s MindSpore reaches on this host (best of ``repeats``)."""
    from mindspore import Tensor, ops

    rng = np.random.default_rng(0)
    a, b = (Tensor(rng.standard_normal((size, size)).astype(np.float32)) for _ in range(2))
    matmul = ops.MatMul()
    matmul(a, b).asnumpy()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).asnumpy()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size ** 3 / best


def memory() -> Dict[str, int]:
    """Peak host RSS of this process and, where the device reports it, MindSpore's peak device memory."""
    stats = {"peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB
    try:
        import mindspore as ms

        if ms.get_context("device_target") == "Ascend":
            stats["peak_device_bytes"] = int(ms.runtime.max_memory_allocated())
    except Exception:  # the device offers no statistics: report the host only  # noqa: BLE001
        pass
    return stats


class Throughput:
    """Per-step figures; see the module docstring."""

    def __init__(self, flops_per_sample: Optional[float] = None, peak_flops: Optional[float] = None,
                 world_size: int = 1, dp_size: int = 1):
        if dp_size < 1 or world_size < dp_size:
            raise ValueError(f"need 1 <= dp_size <= world_size, got dp_size={dp_size}, world_size={world_size}")
        self.flops_per_sample, self.peak_flops = flops_per_sample, peak_flops
        self.world_size, self.dp_size = world_size, dp_size

    def record(self, seconds: float, samples: int, tokens: int = 0, padded_tokens: Optional[int] = None) -> Dict:
        if seconds <= 0:
            raise ValueError(f"a step takes a positive time, got {seconds}")
        padded = tokens if padded_tokens is None else padded_tokens
        out = {"step_seconds": seconds,
               "samples_per_s": samples / seconds, "tokens_per_s": tokens / seconds,
               "padded_tokens_per_s": padded / seconds,
               "cluster_samples_per_s": samples * self.dp_size / seconds,
               "cluster_tokens_per_s": tokens * self.dp_size / seconds,
               "cluster_padded_tokens_per_s": padded * self.dp_size / seconds,
               "mfu": None}
        if self.flops_per_sample and self.peak_flops:
            done = self.flops_per_sample * samples * self.dp_size
            out["mfu"] = done / (seconds * self.peak_flops * self.world_size)
        return out
