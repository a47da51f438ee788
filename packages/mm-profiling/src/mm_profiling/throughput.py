"""Step throughput (SPS, TPS), MFU and memory, per rank and for the cluster.

    meter = Throughput(flops_per_sample=TRAIN_FACTOR * model.flops(batch),
                       peak_flops=host_peak_flops(), world_size=topo.world_size, dp_size=topo.dp.size)
    stats = meter.record(seconds, samples=4, tokens=1800, padded_tokens=2048)
    stats["samples_per_s"], stats["cluster_tokens_per_s"], stats["mfu"]

Counts are this data-parallel replica's (every tp / cp / pp rank of a replica sees the same
samples); cluster figures multiply by the number of replicas. Tokens are real ones, padded ones
are counted separately. MFU = FLOPs the cluster did in the step / (seconds x peak x world size).
The peak is per device: measured on the host for CPU runs (`host_peak_flops`); on Ascend from
`PEAK_FLOPS` or `ascend_cube_peak_flops(ai_cores, clock_ghz)` for the chip you run on
(`step_peak_flops` picks by device target; `step_memory_bytes` reads the device allocator's peaks
on Ascend, the host's peak RSS elsewhere).
"""

from __future__ import annotations

import resource
import time
from typing import Dict, Optional

import numpy as np

# One AI core's Cube unit does 16 x 16 x 16 = 4096 fp16 / bf16 multiply-adds per cycle (Huawei's
# Ascend 910 presentation, Hot Chips 2019: "4096 MACs per AI core per cycle"), i.e. 8192 FLOPs.
CUBE_FLOPS_PER_CYCLE = 2 * 16 * 16 * 16


def ascend_cube_peak_flops(ai_cores: int, clock_ghz: float) -> float:
    """bf16 / fp16 Cube peak of an Ascend chip: AI cores x clock x 8192 FLOPs per cycle. The core
    count and clock of your chip are in CANN's platform_config/<soc>.ini (ai_core_cnt, frequency)."""
    return ai_cores * clock_ghz * 1e9 * CUBE_FLOPS_PER_CYCLE


# Per-device peaks, FLOP/s. Ascend 910B2: 24 AI cores at 1.8 GHz (CANN's platform config, as
# quoted in gitcode.com/cann/ops-nn issue 6033: "353.9T is the 910B2 pure Cube compute"); Cube only,
# the Vector units' ~22 TFLOPS are not counted (MFU measures the matrix work).
PEAK_FLOPS = {
    ("ascend-910b2", "bf16"): ascend_cube_peak_flops(24, 1.8),
    ("ascend-910b2", "fp16"): ascend_cube_peak_flops(24, 1.8),
}


def peak_flops(device: str, dtype: str) -> float:
    """A peak from `PEAK_FLOPS`, or an error listing the ones known."""
    try:
        return PEAK_FLOPS[device.lower(), dtype.lower()]
    except KeyError:
        raise ValueError(f"no peak for ({device!r}, {dtype!r}); known: {sorted(PEAK_FLOPS)}. Use "
                         "ascend_cube_peak_flops(ai_cores, clock_ghz) or host_peak_flops()") from None


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


def step_peak_flops(target: str, device: str, dtype: str) -> Optional[float]:
    """The per-device peak MFU is measured against: on Ascend the chip's (``device`` names a
    `PEAK_FLOPS` entry, mm-train's cluster.device, e.g. ascend-910b2) at the run's precision;
    elsewhere the host's measured float32 matmul rate. None (no MFU) for a chip or dtype without a
    known peak: the run goes on, the caller says why once."""
    if target != "Ascend":
        return host_peak_flops()
    return PEAK_FLOPS.get((device.lower(), dtype.lower()))


def step_memory_bytes(target: str, runtime=None) -> Dict[str, int]:
    """This process's memory for metrics: on Ascend the device allocator's peaks
    (``max_memory_allocated`` / ``max_memory_reserved`` of mindspore.runtime, or ``runtime``),
    elsewhere the host's peak RSS (the CPU's device memory is the host's)."""
    if target != "Ascend":
        return {"bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "source": "host_rss"}
    if runtime is None:
        import mindspore as ms

        runtime = ms.runtime
    return {"bytes": int(runtime.max_memory_allocated()), "reserved_bytes": int(runtime.max_memory_reserved()),
            "source": "device_allocator"}


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
