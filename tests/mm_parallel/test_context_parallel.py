"""Context parallel (Ulysses, Ring, hybrid; causal and full; MHA and GQA) equals one process:
outputs and q/k/v gradients, on 2 and 4 processes; a sequence padded at its end with key_length
equals attention over its real rows (cp 1 too: the dp2 layout); packed samples (segment ids of
the whole row) equal one process's segment-masked attention."""

import pytest
from helpers.cp_cases import run_cp_cases

pytestmark = pytest.mark.distributed

LAYOUTS = {
    2: {"ulysses2": {"cp": 2}, "ring2": {"cp": 2, "cp_algo": "ring"}, "no_cp": {}},
    4: {
        "hybrid2x2": {"cp": 4, "cp_algo": "hybrid", "ulysses_degree": 2},
        "ring4": {"cp": 4, "cp_algo": "ring"},
        "ulysses4": {"cp": 4},
    },
}


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_equals_single_process(run_distributed, world):
    results = run_distributed(run_cp_cases, nproc=world, timeout=420, layouts=LAYOUTS[world])
    expected = {f"{n}/kv{kv}/{m}" for n in LAYOUTS[world] for kv in (4, 2) for m in ("full", "causal")}
    expected |= {f"{n}/round_trip" for n in LAYOUTS[world]}
    expected |= {f"{n}/{kind}/{m}" for n in LAYOUTS[world] for m in ("full", "causal") for kind in ("padded", "packed")}
    for rank, result in enumerate(results):
        assert set(result) == expected
        failed = {case: p for case, p in result.items() if p}
        assert not failed, (rank, failed)
