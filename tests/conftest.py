"""Shared fixtures: `run_distributed` runs a function on msrun workers with a hard timeout.

The parity references are part of the test environment (hatch.toml pins them): a session
without them, or with other versions than the ones the twins are tested against, stops at once
with what to install — a missing reference never turns parity tests into skips.

The workers of one process count are started once per session and kept for the next test
(mm_parallel.launch.pool: a launch costs 14-20 s before any test code runs). A call with
``env`` or ``fresh=True`` gets a launch of its own (mm_parallel.launch.run_distributed).
"""

import os

import pytest
from helpers.compat_tier import in_tier, unmatched
from helpers.references import reference_problems

from mm_parallel import launch
from mm_parallel.launch.pool import WorkerPool


def pytest_sessionstart(session):
    problems = reference_problems()
    if problems:
        pytest.exit("the parity references are required: " + "; ".join(problems) +
                    ". Run the suite with `hatch test --all` (hatch.toml pins them)", returncode=4)


def pytest_collection_modifyitems(config, items):
    """MM_TEST_TIER=compat (hatch.toml's compat environment) keeps the compat tier alone."""
    tier = os.environ.get("MM_TEST_TIER", "")
    if not tier:
        return
    if tier != "compat":
        raise pytest.UsageError(f"MM_TEST_TIER={tier!r}: the only tier is 'compat' (unset it for the whole suite)")
    missing = unmatched([item.nodeid for item in items])
    if missing:
        raise pytest.UsageError("helpers/compat_tier.py names tests that do not exist: " + ", ".join(missing))
    kept = [item for item in items if in_tier(item.nodeid)]
    config.hook.pytest_deselected(items=[item for item in items if not in_tier(item.nodeid)])
    items[:] = kept


@pytest.fixture(scope="session")
def run_distributed():
    """run_distributed(fn, nproc, timeout=..., env=None, fresh=False, **kwargs) -> [result of rank 0, ...]."""
    pools = {}

    def run(fn, nproc, timeout=300.0, env=None, fresh=False, **kwargs):
        if env is not None or fresh:
            return launch.run_distributed(fn, nproc, timeout, env, **kwargs)
        pool = pools.setdefault(nproc, WorkerPool(nproc))
        return pool.run(fn, timeout, **kwargs)

    yield run
    for pool in pools.values():
        pool.close()
