"""Every collective and region map, forward and backward, against numpy on 2 and 4 processes,
through the CPU backend and through the native backend on its stand-ins.

One msrun launch per world size runs all cases (collective_cases.py); each case is reported as
its own test here, so a failure names the op, group, dim and dtype.
"""

import pytest
from helpers.collective_cases import case_names, native_case_names, run_cases

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def outcomes(run_distributed):
    cache = {}

    def get(world_size, native=False):
        if (world_size, native) not in cache:
            cache[world_size, native] = run_distributed(run_cases, nproc=world_size, timeout=420,
                                                        world_size=world_size, native=native)
        return cache[world_size, native]

    return get


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_case_ran_on_every_rank(outcomes, world_size):
    for rank, result in enumerate(outcomes(world_size)):
        assert sorted(result) == sorted(case_names(world_size)), f"rank {rank} ran a different set of cases"


@pytest.mark.parametrize("case", case_names(2))
def test_two_processes(outcomes, case):
    problems = {rank: result[case] for rank, result in enumerate(outcomes(2)) if result[case]}
    assert not problems, problems


@pytest.mark.parametrize("case", case_names(4))
def test_four_processes(outcomes, case):
    problems = {rank: result[case] for rank, result in enumerate(outcomes(4)) if result[case]}
    assert not problems, problems


@pytest.mark.parametrize("case", native_case_names(2))
def test_two_processes_native_backend(outcomes, case):
    """The native (HCCL) backend on documented-semantics stand-ins of mint.distributed."""
    problems = {rank: result[case] for rank, result in enumerate(outcomes(2, native=True)) if result[case]}
    assert not problems, problems


@pytest.mark.parametrize("case", native_case_names(4))
def test_four_processes_native_backend(outcomes, case):
    problems = {rank: result[case] for rank, result in enumerate(outcomes(4, native=True)) if result[case]}
    assert not problems, problems
