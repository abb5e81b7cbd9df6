"""The chain DP (:mod:`sacplan.solver.chain_dp`) against the brute force over options, the tree DP and the MILP.

* on random small trees with exact options, wherever it applies, its optimum equals the brute force of
  ``test_exact`` over every non-nested set of units × options (and it finds nothing where nothing fits), and
  the tree DP's;
* on repeated-block trees with more binding events than the tree DP takes (llama blocks near the minimum budget),
  ``solve`` proves the plan with it (``proved_by == "chain-dp"``, status optimal) within its *work* limit, equal to
  the MILP's proven optimum, with the same plan and work count on every run;
* ``chain_dp=False`` is main's path (tree DP, then the MILP); ``tree_dp=False`` is the MILP alone.
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from sacplan.solver import SolverOptions, solve
from sacplan.solver import chain_dp as chain_mod
from sacplan.solver import tree_dp as dp_mod
from sacplan.solver.chain_dp import solve_chain_dp
from sacplan.solver.milp import baseline_peak, min_feasible_budget
from sacplan.solver.problem import SacProblem
from sacplan.solver.tree_dp import solve_tree_dp
from sacplan.testing.llama_tree import llama_spec
from sacplan.testing.synthetic import build_tree
from oracles import random_budget_case


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(seed=st.integers(0, 2**31 - 1), u=st.floats(0.0, 1.0))
def test_chain_dp_equals_brute_force_over_options(seed, u):
    case = random_budget_case(seed, u)
    assume(case is not None)
    tree, budget, brute, opts = case
    why: list[str] = []
    res = solve_chain_dp(SacProblem(tree, exact=True), budget, None, why)
    if res is None and why[0].startswith("not a sequential chain"):
        event("not a sequential chain")  # repeated calls: the MILP's case
        return
    event("applies")
    if math.isinf(brute):
        assert res is None and why[0].startswith(("no point meets the budget", "the DP's point failed the exact"))
        return
    assert res is not None, why
    assert res.cost_ms == pytest.approx(brute, rel=1e-9, abs=1e-9)
    P = SacProblem(tree, exact=True)
    assert P.peak(res.y, res.r) <= budget and P.nesting_ok(res.y)
    with mock.patch.object(dp_mod, "MAX_BINDING", 10**6), mock.patch.object(dp_mod, "WIDE", 10**6):
        tree_res = solve_tree_dp(P, budget, None)
    assert tree_res is not None and tree_res.cost_ms == pytest.approx(res.cost_ms, rel=1e-9, abs=1e-9)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(seed=st.integers(0, 2**31 - 1), u=st.floats(0.0, 0.3))
def test_incumbent_pass_and_descent_fit_and_bracket_the_optimum(seed, u):
    """The incumbent pass's plan (a few points per front), once improved by the descent, still fits and nests,
    costs what ``cost`` says, never more than before and never less than the brute force's optimum."""
    case = random_budget_case(seed, u)
    assume(case is not None and not math.isinf(case[2]))
    tree, budget, brute, _ = case
    P = SacProblem(tree, exact=True)
    try:
        dp = chain_mod.ChainDp(P, budget, None)
        dp.multiplier()
        dp.beam = True
        first = dp.best()
    except dp_mod.TreeDpGaveUp:
        event("not a sequential chain")
        return
    assume(first is not None)
    y, r, cost = dp.improved(*first)
    assert P.peak(y, r) <= budget and P.nesting_ok(y)
    assert brute - 1e-9 <= cost == pytest.approx(P.cost(y, r)) and cost <= first[2] + 1e-12


@pytest.mark.parametrize("n_blocks, frac", [(4, 0.1), (4, 0.5), (8, 0.5), (8, 0.9)])
def test_equals_tree_dp_on_identical_blocks(n_blocks, frac):
    tree = build_tree(llama_spec(n_blocks))
    lo, hi = min_feasible_budget(tree), baseline_peak(tree)
    budget = int(lo + frac * (hi - lo))
    tree_res = solve_tree_dp(SacProblem(tree, exact=True), budget, None)
    res = solve_chain_dp(SacProblem(tree, exact=True), budget)
    assert tree_res is not None and res is not None
    assert res.cost_ms == pytest.approx(tree_res.cost_ms, rel=1e-9, abs=1e-12)
    # the thresholds guessed above the Lagrangian bound only prune: none at all (one unpruned pass), or one at the
    # bound itself (a pass that finds nothing cheaper, then the unpruned one), give the same optimum
    for guesses in ((), (0.0,)):
        with mock.patch.object(chain_mod, "GUESSES", guesses):
            again = solve_chain_dp(SacProblem(tree, exact=True), budget)
        assert again is not None and again.cost_ms == pytest.approx(res.cost_ms, rel=1e-9, abs=1e-12)


def test_proves_repeated_blocks_past_the_tree_dp_by_work():
    """Eight identical blocks at 10% of the way from the minimum budget to the peak: hundreds of events can bind
    (the tree DP gives up past 16); the chain DP proves the optimum within its work limit (counted, not timed),
    the same plan and the same count on every run, equal to the MILP's proven optimum."""
    tree = build_tree(llama_spec(8))
    lo, hi = min_feasible_budget(tree), baseline_peak(tree)
    budget = int(lo + 0.1 * (hi - lo))
    why: list[str] = []
    assert solve_tree_dp(SacProblem(tree, exact=True), budget, why=why) is None
    assert why[0].startswith("more than 16 of")
    # no wall clock at all: only the work limit can end the search
    plans = [solve(tree, f"{budget}B", options=SolverOptions(time_limit_s=None)) for _ in range(2)]
    for plan in plans:
        assert plan.status == "optimal" and plan.gap == 0.0 and plan.meta["proved_by"] == "chain-dp"
        assert plan.meta["tree_dp_gave_up"].startswith("more than 16 of")
        assert 0 < plan.meta["tree_dp"]["work"] <= chain_mod.WORK
        assert plan.meta["tree_dp"]["binding_events"] > 16
        assert plan.predicted_peak_bytes <= budget
    assert plans[0].to_dict(timings=False) == plans[1].to_dict(timings=False)
    assert plans[0].meta["tree_dp"]["work"] == plans[1].meta["tree_dp"]["work"]
    milp = solve(tree, f"{budget}B", options=SolverOptions(gap_rel=1e-9, tree_dp=False))
    assert milp.status == "optimal" and milp.meta["proved_by"] not in ("tree-dp", "chain-dp")
    assert plans[0].objective_ms == pytest.approx(milp.objective_ms, rel=1e-7, abs=1e-9)
    # main's path: the chain DP off, the MILP proves it as before
    old = solve(tree, f"{budget}B", options=SolverOptions(chain_dp=False, gap_rel=1e-9))
    assert old.meta["proved_by"] not in ("tree-dp", "chain-dp") and "chain_dp" not in old.meta
    assert old.objective_ms == pytest.approx(plans[0].objective_ms, rel=1e-7, abs=1e-9)


def test_work_limit_and_give_up_reasons(monkeypatch):
    tree = build_tree(llama_spec(8))
    lo, hi = min_feasible_budget(tree), baseline_peak(tree)
    budget = int(lo + 0.1 * (hi - lo))
    why: list[str] = []
    assert solve_chain_dp(SacProblem(tree, exact=True), budget, work=1000, why=why) is None
    assert why == ["chain DP work limit (1,000 units)"]
    # past its work limit, solve says why both DPs gave up and runs the MILP
    monkeypatch.setattr(solve_chain_dp, "__defaults__", (1000, None))  # its default work limit
    plan = solve(tree, f"{budget}B", gap_rel=1e-9)
    assert plan.meta["proved_by"] not in ("tree-dp", "chain-dp")
    assert plan.meta["tree_dp"].startswith("more than 16 of") and plan.meta["chain_dp"].startswith("chain DP work")
    lines = SacProblem(tree)  # lines mode: no exact options
    why = []
    assert solve_chain_dp(lines, budget, why=why) is None and why == ["not exact mode"]


def _interleaved_spec():
    """A block called twice per step whose two checkpointable children therefore interleave (c0 c1 c0 c1 in the
    forward): at the events of the second call the held siblings are not a prefix — the overlap of a post-norm
    decoder's cross-attention and norm1 (nn.Transformer), in miniature."""
    from sacplan.testing.synthetic import MiB, Spec, ops_from_rows

    def child(name, rows, act_leaf):
        ops = ops_from_rows(rows)
        sp = Spec(name, act=sum(o.save_cost_bytes for o in ops), fw_ms=sum(o.runtime_ms for o in ops), ops=ops,
                  tmp=16 * MiB)
        sp.children.append(Spec(name + "_leaf", act=act_leaf, fw_ms=0.0, no_tradeoff=True))
        return sp

    c0 = child("c0", [("aten.mm.default", 64 * MiB, 1.0, 0), ("aten.silu.default", 32 * MiB, 0.2, 0)], 16 * MiB)
    c1 = child("c1", [("aten.mul.Tensor", 48 * MiB, 0.4, 0), ("aten.mm.default", 96 * MiB, 2.0, 0)], 0)
    blk = child("blk", [("aten.mul.Tensor", 32 * MiB, 0.3, 0)], 0)
    blk.repeat, blk.children = 2, [c0, c1]
    return Spec("m", params=32 * MiB, fw_ms=0.1, children=[blk, child("c2", [("aten.mm.default", 80 * MiB, 1.5, 0)], 0)])


@pytest.mark.parametrize("u", [0.0, 0.05, 0.2, 0.3])
def test_overlapping_siblings_tracked_exactly(u, monkeypatch):
    """Where sibling subtrees overlap the chain DP tracks those events exactly (it gave up there before): its
    optimum equals the brute force over every non-nested set of units × options, and some chain did see
    overlapping siblings."""
    from oracles import brute_over_options, option_sets, oracle

    tree = build_tree(_interleaved_spec())
    cands, base, C, X = oracle(tree, None)
    _, min_peak = brute_over_options(tree, cands, base, C, X, math.inf, [[(1.0, 1.0)] for _ in cands])
    budget = int(min_peak + u * (float(base.max()) - min_peak))
    brute, _ = brute_over_options(tree, cands, base, C, X, budget, option_sets(cands))
    seen = []
    order = chain_mod.ChainDp.order
    monkeypatch.setattr(chain_mod.ChainDp, "order", lambda self, k, e: seen.append(order(self, k, e)) or seen[-1])
    why: list[str] = []
    res = solve_chain_dp(SacProblem(tree, exact=True), budget, None, why)
    assert any(odd.any() for *_, odd in seen)
    assert res is not None, why
    assert res.cost_ms == pytest.approx(brute, rel=1e-9, abs=1e-9)
    monkeypatch.setattr(chain_mod, "MAX_TRACKED", 0)  # nothing tracked: it gives up, as it did
    why = []
    assert solve_chain_dp(SacProblem(tree, exact=True), budget, None, why) is None
    assert why[0].startswith("not a sequential chain")
