"""The exact tree DP (:mod:`sacplan.solver.tree_dp`) against the brute force over options, the MILP, and its
give-up cases.

* :func:`~sacplan.solver.tree_dp.pareto` equals the definition of the Pareto set (1, 2 and 3 coordinates);
* on random small trees with exact options, the DP optimum equals the brute force of ``test_exact`` over every
  non-nested set of units × options (and proves infeasibility where it finds nothing), and equals ``solve``'s
  objective with the DP disabled;
* identical blocks: merging identical subtrees gives the optimum the DP finds without merging, and ``solve``
  returns it proven (``proved_by == "tree-dp"``);
* it gives up (None, with a reason) on continuous trade-off lines, lines mode, too many binding events, a
  front over its cap and a spent deadline, and ``solve`` then runs the MILP as before.
"""

from __future__ import annotations

import math
import time
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from sacplan.solver import SolverOptions, solve
from sacplan.solver import tree_dp as dp_mod
from sacplan.solver.milp import baseline_peak
from sacplan.solver.problem import SacProblem
from sacplan.solver import limits
from sacplan.solver.tree_dp import TreeDp, TreeDpGaveUp, pareto, solve_tree_dp
from sacplan.testing.llama_tree import llama_spec
from sacplan.testing.synthetic import build_tree, hand_tree
from oracles import random_budget_case


def test_pareto_by_hand():
    cost = np.array([1.0, 2.0, 2.0, 3.0, 1.0, 4.0])
    vec = np.array([[1.0, 5.0], [2.0, 2.0], [1.0, 1.0], [3.0, 3.0], [1.0, 5.0], [0.0, 9.0]])
    # (2, [1, 1]) is dominated by (1, [1, 5]); the second (1, [1, 5]) is an equal copy of the first
    assert sorted(pareto(cost, vec).tolist()) == [0, 1, 3, 5]
    assert pareto(cost[:, None][:0, 0], vec[:0]).tolist() == []
    assert sorted(pareto(cost, vec[:, :1]).tolist()) == [0, 1, 3]


@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 3), n=st.integers(1, 80), seed=st.integers(0, 2**31 - 1))
def test_pareto_equals_definition(k, n, seed):
    rng = np.random.default_rng(seed)
    cost = rng.integers(0, 8, n).astype(float)  # small integers: many ties and equal points
    vec = rng.integers(0, 6, (n, k)).astype(float)
    got = set(pareto(cost, vec).tolist())
    want = set()
    for i in range(n):
        dominated = any((cost[j] <= cost[i]) and (vec[j] >= vec[i]).all() and
                        (cost[j] < cost[i] or (vec[j] > vec[i]).any() or j < i) for j in range(n) if j != i)
        if not dominated:
            want.add(i)
    # of equal points the first in the sort is kept: compare the sets of values
    assert {(cost[i], *vec[i]) for i in got} == {(cost[i], *vec[i]) for i in want}
    assert len(got) == len({(cost[i], *vec[i]) for i in got})


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(seed=st.integers(0, 2**31 - 1), u=st.floats(0.0, 1.0), with_milp=st.booleans())
def test_dp_equals_brute_force_over_options(seed, u, with_milp):
    case = random_budget_case(seed, u)
    assume(case is not None)
    tree, budget, brute, opts = case
    P = SacProblem(tree, exact=True)
    why: list[str] = []
    # every example: the DP over all events that can bind, with no time cap for many of them
    with mock.patch.object(dp_mod, "MAX_BINDING", 10**6), mock.patch.object(dp_mod, "WIDE", 10**6):
        res = solve_tree_dp(P, budget, None, why)
    event(f"{len(res.binding) if res else 0} binding events")
    if math.isinf(brute):
        # nothing fits; a plan within the float slack (1 byte) over the budget fails the exact check instead
        assert res is None and why[0].startswith(("no point meets the budget", "the DP's point failed the exact"))
        return
    assert res is not None, why
    assert res.cost_ms == pytest.approx(brute, rel=1e-9, abs=1e-9)
    assert P.peak(res.y, res.r) <= budget and P.nesting_ok(res.y)
    if with_milp:
        plan = solve(tree, budget, options=SolverOptions(gap_rel=1e-9, tree_dp=False))
        assert plan.meta["proved_by"] != "tree-dp" and plan.meta["tree_dp"] is None
        assert plan.objective_ms == pytest.approx(res.cost_ms, rel=1e-7, abs=1e-9)


@pytest.mark.parametrize("n_blocks, frac", [(2, 0.9), (2, 0.7), (4, 0.9), (8, 0.9)])
def test_identical_blocks(n_blocks, frac, monkeypatch):
    tree = build_tree(llama_spec(n_blocks))
    budget = int(baseline_peak(tree) * frac)
    P = SacProblem(tree, exact=True)
    res = solve_tree_dp(P, budget, None)
    assert res is not None
    # without merging identical subtrees (every subtree its own signature): the same optimum
    monkeypatch.setattr(TreeDp, "signature", lambda self, s: s)
    alone = solve_tree_dp(SacProblem(tree, exact=True), budget, None)
    assert alone is not None and alone.cost_ms == pytest.approx(res.cost_ms, rel=1e-9, abs=1e-12)
    monkeypatch.undo()
    plan = solve(tree, budget)
    assert plan.status == "optimal" and plan.gap == 0.0 and plan.meta["proved_by"] == "tree-dp"
    assert plan.objective_ms == plan.bound_ms == pytest.approx(res.cost_ms, rel=1e-12)
    assert plan.recompute_ms == pytest.approx(plan.objective_ms, rel=1e-9)
    assert plan.predicted_peak_bytes <= budget
    milp = solve(tree, budget, options=SolverOptions(gap_rel=1e-9, tree_dp=False))
    assert milp.objective_ms == pytest.approx(plan.objective_ms, rel=1e-7, abs=1e-9)


def gave_up(P, budget, **kw):
    why: list[str] = []
    t0 = time.perf_counter()
    assert solve_tree_dp(P, budget, why=why, **kw) is None
    assert time.perf_counter() - t0 < 20.0  # milliseconds quiet; wide slack for a loaded host
    return why[0]


def test_gives_up(monkeypatch):
    lines = hand_tree()  # trade-off lines, no ops: no exact options
    assert "continuous trade-off lines" in gave_up(SacProblem(lines, exact=True), 9 * 2**30)
    assert gave_up(SacProblem(lines), 9 * 2**30) == "not exact mode"
    tree = build_tree(llama_spec(2))
    budget = int(baseline_peak(tree) * 0.7)
    P = SacProblem(tree, exact=True)
    monkeypatch.setattr(dp_mod, "MAX_BINDING", 1)
    assert gave_up(P, budget).startswith("more than 1 of")
    monkeypatch.setattr(dp_mod, "MAX_SCREENED", 2)
    assert "to screen" in gave_up(P, budget)
    monkeypatch.undo()
    monkeypatch.setattr(dp_mod, "MAX_FRONT", 3)
    assert "a front reached" in gave_up(P, budget)
    monkeypatch.undo()
    with pytest.raises(TreeDpGaveUp, match="work limit"):
        TreeDp(P, budget, work=0).solve()
    # more than WIDE binding events: at most WIDE_WORK units, however much the caller allows
    monkeypatch.setattr(dp_mod, "WIDE", 0)
    monkeypatch.setattr(dp_mod, "WIDE_WORK", 0)
    assert gave_up(P, budget).startswith("work limit")
    monkeypatch.undo()
    # the wall clock is only the safety net: when it fires the DP gives up and the call records it
    with limits.work(None) as stops, limits.deadline(1e-9):
        time.sleep(0.01)
        assert gave_up(P, budget) == "wall-clock safety net (time limit)"
    assert stops == [(limits.WALL_CLOCK, "tree DP")]
    # solve runs the chain DP (test_chain_dp), or without it the MILP as before, and says why the DP did not apply
    monkeypatch.setattr(dp_mod, "MAX_BINDING", 1)
    plan = solve(tree, budget, options=SolverOptions(chain_dp=False))
    assert plan.status == "optimal" and plan.meta["proved_by"] not in ("tree-dp", "chain-dp")
    assert plan.meta["tree_dp"].startswith("more than 1 of")
    plan = solve(tree, budget)
    assert plan.status == "optimal" and plan.meta["proved_by"] == "chain-dp"
    assert plan.meta["tree_dp_gave_up"].startswith("more than 1 of")


@pytest.mark.parametrize("seed", [0, 1])
def test_pareto_prefilter_changes_nothing(seed):
    """Past :data:`~sacplan.solver.tree_dp.PREFILTER_MIN` two-coordinate points, :func:`pareto` first drops what an
    earlier block dominates: the same indices in the same order as the full sort alone, ties (equal costs, equal
    points) included; the pre-filter keeps a superset and drops most of a large sum."""
    rng = np.random.default_rng(seed)
    n = 3 * dp_mod.PREFILTER_MIN
    cost = rng.integers(0, 400, n).astype(float)  # many equal costs and equal points
    vec = rng.integers(0, 60, (n, 2)).astype(float) + cost[:, None] // 8  # dearer points tend to offer more
    got = pareto(cost, vec)
    with mock.patch.object(dp_mod, "PREFILTER_MIN", 10 * n):
        want = pareto(cost, vec)
    assert got.tolist() == want.tolist()
    pre = dp_mod.prefilter_2d(cost, vec)
    assert set(want.tolist()) <= set(pre.tolist()) and len(pre) < n // 2
    assert pre.tolist() == sorted(pre.tolist())
    # on a staircase (each point more of one coordinate, less of the other) it gives up: nothing to drop
    x = rng.permutation(n).astype(float)
    assert dp_mod.prefilter_2d(cost, np.column_stack([x, -x])) is None
    assert sorted(pareto(cost, np.column_stack([x, -x])).tolist()) == list(range(n))


def test_pareto_keeps_its_work_limit_on_large_fronts():
    """Mutually non-dominated points are the filter's worst case (quadratic in the points kept with 3 or more
    coordinates: minutes for 50,000): it must end at its work limit, not after the whole front, and at the same
    count on every run (work is counted, never timed)."""
    rng = np.random.default_rng(0)
    for k in (2, 8):
        v = rng.random((60_000, k))
        v /= v.sum(1, keepdims=True)
        cost = rng.random(len(v))
        counted = []
        for _ in range(2):
            seen = [0]

            def spend(units: int) -> None:
                seen[0] += units
                if seen[0] > 1_000_000:
                    raise TreeDpGaveUp("work limit")

            t0 = time.perf_counter()
            with pytest.raises(TreeDpGaveUp, match="work limit"):
                pareto(cost, v, spend)
            assert time.perf_counter() - t0 < 20.0  # wide slack for a loaded host (the whole front: minutes)
            counted.append(seen[0])
        assert counted[0] == counted[1] > 1_000_000
