"""Rounds of disjoint pairs: how the CPU backend builds all-to-all and ring shifts from two-rank
collectives without deadlock (every rank takes part in at most one pair per round, and all ranks
walk the rounds in the same order). Pure functions of group positions, so they are unit-tested.
"""

from __future__ import annotations

from math import gcd
from typing import List, Optional, Tuple


def round_robin(n: int) -> List[List[Optional[int]]]:
    """Rounds in which every pair of the n positions meets once (the circle method).

    ``rounds[k][i]`` is the partner of position i in round k, or None when i sits out (odd n).
    n - 1 rounds for even n, n for odd n.
    """
    m = n if n % 2 == 0 else n + 1  # an odd count gets a dummy position m - 1 = n
    rounds = []
    for k in range(m - 1):
        partner: List[Optional[int]] = [None] * m
        for i in range(m - 1):
            j = (k - i) % (m - 1)
            if j == i:
                partner[i], partner[m - 1] = m - 1, i
            else:
                partner[i] = j
        rounds.append([p if p is not None and p < n else None for p in partner[:n]])
    return rounds


def shift_rounds(n: int, offset: int) -> List[List[Tuple[Optional[int], Optional[int]]]]:
    """One-way transfers i -> (i + offset) mod n, cut into rounds of disjoint pairs.

    ``rounds[k][i]`` is (send_to, receive_from) of position i in round k (either may be None).
    The shift splits into gcd(n, offset) cycles of length L; alternate edges of a cycle go in
    alternate rounds, so two rounds suffice for even L and three for odd L (the closing edge).
    """
    offset %= n
    if offset == 0:
        return []
    length = n // gcd(n, offset)
    count = 2 if length % 2 == 0 else 3
    rounds: List[List[Tuple[Optional[int], Optional[int]]]] = [[(None, None)] * n for _ in range(count)]
    for start in range(gcd(n, offset)):
        cycle = [(start + p * offset) % n for p in range(length)]
        for p, sender in enumerate(cycle):
            receiver = cycle[(p + 1) % length]
            k = 2 if (length % 2 and p == length - 1) else p % 2
            rounds[k][sender] = (receiver, rounds[k][sender][1])
            rounds[k][receiver] = (rounds[k][receiver][0], sender)
    return rounds
