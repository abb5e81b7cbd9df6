"""Candidates whose discard autocast's weight cache partly holds until the forward ends
(:attr:`~sacplan.stats.ModuleStats.cache_held`): the forward overhead exceeds the backward one.

Random option trees (oracles.random_option_spec) with part of each module's activations marked as cached casts.
Under the exact evaluation (:meth:`SacProblem.peaks`), every exact solver (tree DP, chain DP, MILP) must return a
plan that fits and nests and costs no more than the brute-force optimum over the options at or above each
candidate's ``min_ratio`` (the solvers' own model) and no less than the one over every option (where a forward
overhead exceeds the backward one, options below ``min_ratio`` free bytes at backward events only; the descent may
still reach them), or give up cleanly; and the plan evaluator (:func:`sacplan.evaluate.event_peaks`) must agree with
that evaluation event by event.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from sacplan.evaluate import event_peaks
from sacplan.solver import SolverOptions, solve
from sacplan.solver.chain_dp import solve_chain_dp
from sacplan.solver.problem import SacProblem
from sacplan.solver.tree_dp import solve_tree_dp
from sacplan.testing.synthetic import build_tree
from sacplan.tree import ModuleTree
from sacplan.units import Bytes
from oracles import random_option_spec


def _cached_tree(seed: int) -> ModuleTree:
    """A random option tree where each module with activations has 0-3 eighths of each call's marked cached."""
    rng = random.Random(seed)
    tree = build_tree(random_option_spec(rng))
    mods = []
    for m in tree.stats.modules:
        eighths = rng.randint(0, 3)
        ch = tuple(a * eighths // 8 for a in m.act_bytes)
        mods.append(dataclasses.replace(m, cache_held=ch if any(ch) else ()))
    return ModuleTree(dataclasses.replace(tree.stats, modules=tuple(mods)))


def _brute(P: SacProblem, budget: float, restricted: bool) -> tuple[float, np.ndarray, np.ndarray]:
    """(cheapest cost, its y, its r) over every nesting decision and option (``restricted``: those at or above the
    candidate's ``min_ratio``); inf when none fits."""
    n = P.num_candidates
    best = (math.inf, np.zeros(n), np.zeros(n))
    for y in itertools.product((0.0, 1.0), repeat=n):
        if not P.nesting_ok(y):
            continue
        on = [s for s in range(n) if y[s]]
        choices = []
        for s in on:
            o = P.options(s)
            ratios = [1.0] if o is None else [r for r in o.ratio if r >= P.candidates[s].min_ratio or not restricted]
            choices.append(ratios)
        for pick in itertools.product(*choices):
            r = np.zeros(n)
            r[on] = pick
            if P.peak(y, r) <= budget and P.cost(y, r) < best[0]:
                best = (P.cost(y, r), np.asarray(y), r)
    return best


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(seed=st.integers(0, 2**31 - 1), u=st.floats(0.0, 1.0))
def test_exact_solvers_find_the_optimum_with_cached_casts(seed, u):
    tree = _cached_tree(seed)
    P = SacProblem(tree, exact=True, max_options=None)
    assume(P.num_candidates and any(c.cache_held_bytes for c in P.candidates))
    lo, hi = P.lower_bound_peak(), P.baseline_peak()
    assume(lo < hi - 1)
    budget = int(lo + u * (hi - lo))
    brute, by, br = _brute(P, budget, True)
    low = _brute(P, budget, False)[0]
    # the evaluator agrees with the solver's evaluation (both discard A·r per call; no surges here)
    if math.isfinite(brute) and by.any():
        discards = {c.fqn: tuple(a * br[c.slot] for a in c.act_bytes) for c in P.candidates if by[c.slot]}
        np.testing.assert_allclose(event_peaks(tree, discards), P.peaks(by, br), atol=1.0)
    for name, dp in (("tree DP", solve_tree_dp), ("chain DP", solve_chain_dp)):
        why: list[str] = []
        res = dp(SacProblem(tree, exact=True, max_options=None), budget, None, why)
        if res is None:
            event(f"{name}: {why[0].split(':')[0][:40]}")
            assert not math.isfinite(brute) or not why[0].startswith("no point meets the budget"), why
            continue
        event(f"{name} applies")
        assert low - 1e-9 <= res.cost_ms <= brute + 1e-9
        assert P.peak(res.y, res.r) <= budget and P.nesting_ok(res.y)
    if math.isfinite(brute):
        plan = solve(tree, Bytes(budget), options=SolverOptions(gap_rel=0.0, tree_dp=False, chain_dp=False,
                                                                time_limit_s=None, max_options=None))
        y, r = np.zeros(P.num_candidates), np.zeros(P.num_candidates)
        for d in plan.decisions:
            s = next(c.slot for c in P.candidates if c.fqn == d.fqn)
            y[s], r[s] = 1.0, d.discard_ratio
        assert P.peak(y, r) <= budget and P.cost(y, r) == pytest.approx(plan.recompute_ms, rel=1e-9, abs=1e-9)
        assert low - 1e-6 <= plan.recompute_ms <= brute + 1e-6
