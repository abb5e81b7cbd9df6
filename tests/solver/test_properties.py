"""Property test: the MILP against a brute force over checkpoint sets × discretised ratios.

The oracle (tests/solver/oracles.py) re-derives every event's predicted bytes straight from the stats (the
formula in :mod:`sacplan.timeline`'s docstring), independently of :class:`sacplan.timeline.Timeline` and
:class:`sacplan.solver.problem.SacProblem`.

Discretisation bound: take the MILP optimum (y*, r*) and round every ratio *up* to the grid,
``r' = ceil(20·r)/20 ≤ r + 1/20``. Predicted bytes only fall as ratios grow, so (y*, r') is feasible and on
the grid, and its cost exceeds the optimum by at most ``Σ_{i chosen} calls_i · R_i · max(0, max_s slope_s)/20``
(the trade-off is convex piecewise linear, so its slope on [r, r'] is at most the largest line slope). Hence
``MILP ≤ brute ≤ MILP + that bound`` (the first inequality because the grid is a subset of the feasible set).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import random
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from sacplan.errors import InfeasibleBudgetError
from sacplan.solver import budget_milp as budget_mod
from sacplan.solver import solve
from sacplan.testing.synthetic import build_tree, random_spec
from oracles import antichains, oracle

GRID = 20


def cost_matrix(cands, combo, R):
    """Recompute ms of each grid row R (n × k) for the chosen candidates."""
    total = np.zeros(R.shape[0])
    for col, j in enumerate(combo):
        t = cands[j].stats.tradeoff
        calls = len(cands[j].stats.act_bytes)
        q = np.zeros(R.shape[0])
        for a, b in zip(t.slopes, t.intercepts):
            q = np.maximum(q, a * R[:, col] + b)
        total += calls * t.full_recompute_ms * q
    return total


def brute_force(tree, cands, base, C, X, budget):
    grid = np.arange(GRID + 1) / GRID
    best = (math.inf, None)
    min_peak = math.inf
    for combo in antichains(tree, cands):
        k = len(combo)
        extra = X[:, list(combo)].sum(axis=1) if k else 0.0
        ones = np.ones((1, k))
        m1 = base - (ones @ C[:, list(combo)].T if k else 0.0) + extra
        min_peak = min(min_peak, float(np.max(m1)))
        R = np.array(list(itertools.product(grid, repeat=k))) if k else np.zeros((1, 0))
        m = base[None, :] - (R @ C[:, list(combo)].T if k else 0.0) + extra
        ok = np.max(m, axis=1) <= budget
        if not ok.any():
            continue
        cost = cost_matrix(cands, combo, R)[ok]
        i = int(np.argmin(cost))
        if cost[i] < best[0]:
            best = (float(cost[i]), (combo, R[ok][i]))
    return best, min_peak


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(
    seed=st.integers(0, 2**31 - 1),
    u=st.floats(-0.15, 1.0),
    world_size=st.sampled_from([None, 1, 2, 4]),
    solver=st.sampled_from(["cbc", "highs"]),
    search=st.booleans(),
)
def test_milp_equals_brute_force(seed, u, world_size, solver, search):
    rng = random.Random(seed)
    tree = build_tree(random_spec(rng, max_modules=8))
    cands, base, C, X = oracle(tree, world_size)
    units = None
    if sum((GRID + 1) ** len(c) for c in antichains(tree, cands)) > 400_000:
        # too many grid points for the brute force: leaves out of the candidate set (named units instead)
        keep = [j for j, n in enumerate(cands) if not n.is_leaf]
        cands, C, X = [cands[j] for j in keep], C[:, keep], X[:, keep]
        units = [n.fqn for n in cands]
    baseline = float(np.max(base))
    _, min_peak = brute_force(tree, cands, base, C, X, math.inf)
    # only trees where checkpointing can lower the peak count as examples
    assume(cands and min_peak < baseline - 1)
    budget = int(min_peak + u * (baseline - min_peak))
    if budget <= 0:
        return
    if budget < min_peak:
        event("infeasible budget")
        with pytest.raises(InfeasibleBudgetError) as ei:
            solve(tree, budget, world_size=world_size, solver=solver, op_level=False, ac_units=units)
        # the computed minimum is the exact minimum (r = 1 is optimal for the peak given the units)
        assert ei.value.min_feasible_bytes == math.ceil(min_peak - 1e-6)
        return
    with contextlib.ExitStack() as stack:
        if search:  # no shortcut: the back-end's branch-and-bound must prove the optimum
            stack.enter_context(mock.patch.object(budget_mod, "prove_by_lp_branching", lambda *a, **k: None))
        plan = solve(tree, budget, world_size=world_size, solver=solver, op_level=False, gap_rel=1e-9, ac_units=units)
    assert plan.predicted_peak_bytes <= budget
    (brute, arg), _ = brute_force(tree, cands, base, C, X, budget)
    if budget >= baseline:
        event("no checkpointing needed")
        assert plan.status == "not needed" and brute == 0.0
        return
    assert plan.status == "optimal"
    event(f"optimal, {len(plan.decisions)} checkpointed of {len(cands)} candidates")
    milp = plan.objective_ms
    assert milp <= brute + 1e-6 * (1 + abs(brute))
    by_fqn = {n.fqn: n for n in cands}
    bound = 0.0
    for d in plan.decisions:
        t = by_fqn[d.fqn].stats.tradeoff
        bound += d.calls * t.full_recompute_ms * max(0.0, max(t.slopes)) / GRID
    assert brute - milp <= bound + 1e-6 * (1 + abs(brute))
    # the oracle agrees with the plan's own predicted peak for its realised ratios
    y = np.array([1.0 if by_fqn[c.fqn].fqn in plan.decisions_dict() else 0.0 for c in cands])
    r = np.array([plan.decisions_dict().get(c.fqn, 0.0) for c in cands])
    m = base - C @ r + X @ y
    assert math.ceil(float(np.max(m)) - 1e-6) == plan.predicted_peak_bytes
