"""Throughput and MFU arithmetic, the host peak measurement and memory statistics."""

import pytest


def test_throughput_per_rank_and_cluster():
    from mm_profiling.throughput import Throughput

    meter = Throughput(flops_per_sample=3e9, peak_flops=1e11, world_size=8, dp_size=2)
    s = meter.record(2.0, samples=4, tokens=1800, padded_tokens=2048)
    assert s["samples_per_s"] == 2.0 and s["tokens_per_s"] == 900.0 and s["padded_tokens_per_s"] == 1024.0
    assert s["cluster_samples_per_s"] == 4.0 and s["cluster_tokens_per_s"] == 1800.0
    # 2 replicas x 4 samples x 3 GFLOP in 2 s on 8 devices of 100 GFLOP/s
    assert s["mfu"] == pytest.approx(24e9 / (2.0 * 1e11 * 8))
    assert Throughput().record(1.0, samples=1)["mfu"] is None
    with pytest.raises(ValueError, match="dp_size"):
        Throughput(world_size=2, dp_size=4)
    with pytest.raises(ValueError, match="positive time"):
        meter.record(0.0, samples=1)


def test_host_peak_and_memory():
    from mm_profiling.throughput import host_peak_flops, memory

    peak = host_peak_flops(size=256, repeats=2)
    assert 1e8 < peak < 1e13  # a CPU: between 0.1 GFLOP/s and 10 TFLOP/s
    assert memory()["peak_host_rss_bytes"] > 50 * 2 ** 20


def test_ascend_peaks_follow_the_cube_arithmetic():
    from mm_profiling.throughput import ascend_cube_peak_flops, peak_flops

    # 24 AI cores x 1.8 GHz x 16^3 multiply-adds x 2 = 353.9 TFLOPS (the 910B2 figure quoted by CANN)
    assert peak_flops("Ascend-910B2", "bf16") == pytest.approx(353.9e12, rel=1e-3)
    assert ascend_cube_peak_flops(32, 1.0) == 32 * 1e9 * 8192
    with pytest.raises(ValueError, match="known"):
        peak_flops("ascend-910b2", "fp8")


def test_the_peak_and_memory_follow_the_device():
    """On Ascend MFU is against the chip's table peak at the run's precision and memory is the
    device allocator's peaks (the calls recorded on a stand-in of mindspore.runtime); on CPU the
    host's measured rate and peak RSS."""
    from mm_profiling.throughput import PEAK_FLOPS, step_memory_bytes, step_peak_flops

    assert step_peak_flops("Ascend", "Ascend-910B2", "bf16") == PEAK_FLOPS["ascend-910b2", "bf16"] == 24 * 1.8e9 * 8192
    assert step_peak_flops("Ascend", "ascend-910b2", "fp32") is None  # no Cube fp32 peak known: no MFU
    assert step_peak_flops("CPU", "ascend-910b2", "bf16") > 1e9  # measured here

    calls = []

    class Runtime:  # mindspore.runtime's allocator statistics, as documented: bytes as int
        def max_memory_allocated(self):
            calls.append("allocated")
            return 3 << 30

        def max_memory_reserved(self):
            calls.append("reserved")
            return 4 << 30

    assert step_memory_bytes("Ascend", Runtime()) == {"bytes": 3 << 30, "reserved_bytes": 4 << 30,
                                                      "source": "device_allocator"}
    assert calls == ["allocated", "reserved"]
    host = step_memory_bytes("CPU")
    assert host["source"] == "host_rss" and host["bytes"] > 50 << 20
