"""Shared fixtures: `run_distributed` starts msrun workers with a hard timeout (mm_parallel.testing)."""

import pytest

from mm_parallel import testing


@pytest.fixture(scope="session")
def run_distributed():
    """run_distributed(fn, nproc, timeout=..., **kwargs) -> [result of rank 0, rank 1, ...]."""
    return testing.run_distributed
