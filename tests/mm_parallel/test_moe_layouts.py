"""MoE with expert parallelism equals one process: every layout of moe_cases.CASES over three
optimizer steps, the expert layouts on disk read slice by slice and written back, and an ep2 run
resumed under ep1 and ep4 — all in one launch of 4 workers."""

import pytest


@pytest.mark.distributed
def test_moe_layouts_equal_one_process(run_distributed, tmp_path):
    from helpers.moe_cases import CASES, run_moe_cases
    from helpers.moe_model import write_checkpoints

    write_checkpoints(str(tmp_path))
    results = run_distributed(run_moe_cases, nproc=4, timeout=1500, root=str(tmp_path))
    for rank, result in enumerate(results):
        failed = {name: problems for name, problems in result.items() if problems and not name.endswith("names")}
        assert not failed, (rank, failed)
    for case in CASES:
        names = set().union(*(r.get(f"{case}:names", []) for r in results))
        assert names == set().union(*(r.get(f"{case}:reference_names", []) for r in results)), case
