"""Profiler control, timers, throughput / MFU, memory and reports for MindSpore training.

Skeleton only: the implementation arrives with issue 8; nothing here works yet.
"""

from mm_profiling.__about__ import __version__

__all__ = ["__version__"]
