"""The integer one-event bound (:mod:`sacplan.solver.event_knapsack`): exact sets and arrays on hand numbers, and
never above the brute-force optimum over every non-nested choice of levels on random forests."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sacplan.solver import event_knapsack as ek
from sacplan.solver.event_knapsack import EventKnapsack


def _hand(units: int = 10) -> EventKnapsack:
    # slot 0 (cost 5 ms for 10 bytes) over its children 1 (1 ms: 3 B, 2 ms: 6 B) and 2 (1.5 ms: 4 B)
    levels = [(np.array([5.0]), np.array([10.0])), (np.array([1.0, 2.0]), np.array([3.0, 6.0])),
              (np.array([1.5]), np.array([4.0]))]
    return EventKnapsack([[1, 2], [], []], levels, 10.0, lambda n: None, units)


def test_sets_and_arrays_by_hand():
    kn = _hand()
    b, c = kn.sparse(0)
    # the children's sums (0,0) (3,1) (4,1.5) (6,2) (7,2.5) (10,3.5); the parent's own (10, 5) is beaten by (10, 3.5)
    assert b.tolist() == [0, 3, 4, 6, 7, 10] and c.tolist() == [0, 1, 1.5, 2, 2.5, 3.5]
    d = kn.add(kn.nothing(), kn.sparse(0))  # w = 1 byte: exact at every grid point
    assert d.tolist() == [0, 1, 1, 1, 1.5, 2, 2, 2.5, 3.5, 3.5, 3.5]
    assert kn.needed(6.5).item() == 6 and kn.needed(-3).item() == 0 and kn.needed(99).item() == 10


def test_large_subtrees_enter_as_their_arrays(monkeypatch):
    exact = _hand()
    d_exact = exact.add(exact.nothing(), exact.sparse(0))
    monkeypatch.setattr(ek, "SMALL", 0)  # every subtree: a dense array, then its staircase one unit up
    kn = _hand()
    b, c = kn.sparse(2)  # the leaf's array [0, 1.5 x4, inf...]: steps x = 0 and 4, entered at (x + 1)·w
    assert b.tolist() == [1, 5] and c.tolist() == [0, 1.5]
    d = kn.add(kn.nothing(), kn.sparse(0))
    assert (d <= d_exact).all() and d[0] == 0 and d[10] > 0  # a lower bound (a unit lost per subtree at most)
    monkeypatch.setattr(ek, "SMALL", 32)
    # a set added to an array: each point shifted by ceil(b / w) units (w = 2 B: slot 1's 3 B count as 4 B), so
    # 4 B for 1 ms (truly 1.5) and 8 B for 2.5 ms (truly 3.5: 3 + 4 B counted as 8): optimistic, a lower bound
    kn2 = _hand(units=5)
    d = kn2.add(kn2.add(kn2.nothing(), kn2.sparse(2)), kn2.sparse(1))
    assert d.tolist() == [0, 1, 1, 2, 2.5, 3.5]


def test_a_set_of_many_points_is_rounded_up_first(monkeypatch):
    """A set of more than MAX_STEPS points added to a non-empty array has its bytes rounded up to ``need /
    MAX_STEPS`` first. MAX_STEPS 1: slot 1's set (0, 0) (3, 1) (6, 2) becomes (0, 0) (10, 1), so with slot 2's array
    (1.5 ms from 1 to 4 units) every grid point past 0 costs 1 ms: below the exact array everywhere."""
    exact = _hand()
    d_exact = exact.add(exact.add(exact.nothing(), exact.sparse(2)), exact.sparse(1))
    monkeypatch.setattr(ek, "MAX_STEPS", 1)
    kn = _hand()
    d = kn.add(kn.add(kn.nothing(), kn.sparse(2)), kn.sparse(1))
    assert d.tolist() == [0] + [1] * 10
    assert d_exact.tolist() == [0, 1, 1, 1, 1.5, 2, 2, 2.5, 3.5, 3.5, 3.5] and (d <= d_exact).all()


def _brute(children, levels, need):
    """Least cost of a non-nested choice of levels contributing >= need (contributions below 0 count as 0)."""
    n = len(children)
    parent = [-1] * n
    for s, kids in enumerate(children):
        for k in kids:
            parent[k] = s

    def nested(chosen):
        for s in chosen:
            p = parent[s]
            while p >= 0:
                if p in chosen:
                    return True
                p = parent[p]
        return False

    best = math.inf
    for mask in range(1 << n):
        chosen = [s for s in range(n) if mask >> s & 1]
        if nested(set(chosen)):
            continue
        for pick in itertools.product(*[range(len(levels[s][0])) for s in chosen]):
            got = sum(max(0.0, levels[s][1][k]) for s, k in zip(chosen, pick))
            if got >= need:
                best = min(best, sum(levels[s][0][k] for s, k in zip(chosen, pick)))
    return best


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), units=st.sampled_from([3, 16, 4096]), small=st.sampled_from([0, 32]))
def test_never_above_the_brute_force(seed, units, small):
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    children: list[list[int]] = [[] for _ in range(n)]
    for s in range(1, n):  # pre-order: a parent before its children
        if rng.random() < 0.6:
            children[rng.randrange(s)].append(s)
    top = [s for s in range(n) if all(s not in kids for kids in children)]
    levels = [(np.array(sorted(rng.uniform(0.1, 5) for _ in range(k))), np.array([rng.uniform(-2, 9) for _ in range(k)]))
              for k in (rng.randint(1, 3) for _ in range(n))]
    need = rng.uniform(1, 20)
    old = ek.SMALL
    ek.SMALL = small
    try:
        kn = EventKnapsack(children, levels, need, lambda m: None, units)
        d = kn.nothing()
        for s in top:
            d = kn.add(d, kn.sparse(s))
    finally:
        ek.SMALL = old
    bound = d[kn.needed(need)]
    assert bound <= _brute(children, levels, need) + 1e-9
    for x in range(0, units + 1, max(1, units // 8)):  # every grid point: at most the cost of reaching x·w
        assert d[x] <= _brute(children, levels, x * kn.w) + 1e-9


def test_counts_its_work():
    spent = []
    kn = EventKnapsack([[1, 2], [], []], _hand().levels, 10.0, spent.append, 10)
    kn.add(kn.add(kn.nothing(), kn.sparse(1)), kn.sparse(2))
    assert sum(spent) > 0 and pytest.approx(kn.w) == 1.0
