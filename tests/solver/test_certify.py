"""``certify``: the best plan over every plan (every unit, whole save-list fronts) equals a brute force over
every non-nested set of units (the root included) × every op subset of each; the bound lies below it."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from sacplan.errors import InfeasibleBudgetError
from sacplan.solver import certify, every_unit, solve
from sacplan.testing.synthetic import MiB, build_tree
from oracles import brute_over_options, oracle, pareto_points, random_option_spec, subsets


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(seed=st.integers(0, 2**31 - 1), u=st.floats(0.0, 1.0))
@example(seed=2_147_483_647, u=1.0)  # a zero lower bound is not a zero best plan (it was returned as one)
def test_certificate_is_the_brute_force_over_every_plan(seed, u):
    tree = build_tree(random_option_spec(random.Random(seed)))
    cands, base, C, X = oracle(tree, None, with_root=True)
    assert [n.fqn for n in cands] == every_unit(tree)
    # units with an op list (the synthetic root has none: its cost would be a trade-off line, not a save list)
    keep = [j for j, n in enumerate(cands) if n.stats.ops]
    cands, C, X = [cands[j] for j in keep], C[:, keep], X[:, keep]
    assume(cands)
    full = []
    for n in cands:
        t = n.stats.tradeoff
        full.append(pareto_points(subsets(n.stats.ops, t.max_discard_bytes, t.full_recompute_ms)))
    baseline = float(np.max(base))
    _, min_peak = brute_over_options(tree, cands, base, C, X, math.inf, [[(1.0, 1.0)] for _ in cands])
    assume(min_peak < baseline - 1)
    budget = int(min_peak + u * (baseline - 1 - min_peak))
    best, _ = brute_over_options(tree, cands, base, C, X, budget, full)
    cert = certify(tree, budget, units=[n.fqn for n in cands])
    assert cert.proven and cert.best_ms == pytest.approx(best, rel=1e-7, abs=1e-9)
    assert cert.lower_bound_ms <= best + 1e-6 * (1 + best)
    # the default plan (root excluded, pruned fronts) can only be as good or worse
    assert solve(tree, budget).extra_ms >= cert.best_ms - 1e-9
    line = cert.summary(reference_ms=2 * best if best else None)
    assert "proven optimal over every plan" in line and "no plan below" in line


def test_certify_trivial_and_infeasible():
    tree = build_tree(random_option_spec(random.Random(3)))
    _, base, _, _ = oracle(tree, None, with_root=True)
    c = certify(tree, int(np.max(base)) + 1)
    assert c.proven and c.best_ms == 0.0 and c.lower_bound_ms == 0.0
    with pytest.raises(InfeasibleBudgetError) as ei:
        certify(tree, 1 * MiB)
    assert ei.value.min_feasible_bytes > 1 * MiB
