"""The pair schedules behind the CPU all-to-all and ring shift: complete, disjoint, consistent."""

import itertools

import pytest

from mm_parallel.comm.schedules import round_robin, shift_rounds


@pytest.mark.parametrize("n", range(1, 10))
def test_round_robin_meets_every_pair_once(n):
    rounds = round_robin(n)
    assert len(rounds) == (n - 1 if n % 2 == 0 else n) or n == 1
    met = []
    for partners in rounds:
        for i, j in enumerate(partners):
            if j is not None:
                assert partners[j] == i and j != i  # symmetric, so pairs are disjoint
                met.append((min(i, j), max(i, j)))
    assert sorted(set(met)) == sorted(itertools.combinations(range(n), 2))
    assert len(met) == 2 * len(set(met))  # each pair seen once from each side


@pytest.mark.parametrize("n,offset", [(n, d) for n in range(2, 9) for d in range(-n, n + 1)])
def test_shift_rounds_deliver_every_edge_once_in_disjoint_pairs(n, offset):
    rounds = shift_rounds(n, offset)
    if offset % n == 0:
        assert rounds == []
        return
    assert len(rounds) <= 3
    received = {}
    for transfers in rounds:
        for i, (to, frm) in enumerate(transfers):
            assert to is None or frm is None or to != i  # never both ways with oneself
            if to is not None:
                assert transfers[to][1] == i
            if frm is not None:
                assert transfers[frm][0] == i
                assert i not in received
                received[i] = frm
            busy = [x for x in (to, frm) if x is not None]
            assert len(busy) <= 1, f"rank {i} is in two transfers in one round"
    assert received == {i: (i - offset) % n for i in range(n)}
