"""Module-level MILP: hand-checked optimum, budgets at the edges, unit restrictions, solvers, determinism."""

from __future__ import annotations

import math
import warnings

import pytest

from sacplan.errors import ConfigError, InfeasibleBudgetError, SolverError
from sacplan.plan import Plan
from sacplan.solver import SolverOptions, baseline_peak, min_feasible_budget, solve
from sacplan.solver import budget_milp as budget_mod
from sacplan.solver import milp as milp_mod
from sacplan.solver import heuristic as search_mod
from sacplan.solver.candidates import envelope
from sacplan.solver.formulation import build_budget_model
from sacplan.solver.milp import TimeLimitWarning
from sacplan.solver.model import TIME_LIMIT, SolveResult
from sacplan.solver.problem import SacProblem
from sacplan.testing.llama_tree import llama_tree
from sacplan.testing.synthetic import GiB, MiB, Spec, build_tree, hand_tree

UNITS = ["b0", "b1"]


# --------------------------------------------------------------------------------------------------------
# The worked example (sacplan/testing/synthetic.py:hand_tree)
#
#   b0, b1: A = 4 GiB, R = 10 ms, q = 0.2·y + 0.8·r   (so cost_i = 10·(0.2·y_i + 0.8·r_i) ms)
#   fw_post_order = (b0, b1, ""), bw_pre_order = ("", b1, b0)
#   loss  (fw, fw_done=3):      m1 = 10 − 4·r0 − 4·r1                 [GiB]
#   rc b1 (bw_started=2):       m2 = 10 − 4·r0 + 1·y1   (b1 re-materialised, only b0's discard absent)
#   bw b0 (bw_started=3):       m3 = 6
#   optimizer (other):          m4 = 3
#
# Budget 8 GiB: m2 ≤ 8 needs 4·r0 ≥ 2 + y1.
#   y1 = 0: r0 ≥ 0.5, and then m1 ≤ 8 holds; cost 10·(0.2 + 0.8·0.5) = 6 ms.
#   y1 = 1: r0 ≥ 0.75: cost ≥ 10·(0.2 + 0.6) + 10·0.2 = 10 ms.
#   => optimum: checkpoint b0 only, r0 = 0.5, 6 ms, predicted peak max(8, 8, 6, 3) = 8 GiB.
# Smallest feasible budget: m3 = 6 GiB can never go down; y = (1, 0), r0 = 1 reaches m1 = m2 = 6 GiB.
#   => 6 GiB; at 6 GiB the plan is b0 with r0 = 1 (10 ms); any smaller budget is infeasible.
# Baseline (no checkpointing): 10 GiB.
# --------------------------------------------------------------------------------------------------------
def test_hand_checked_optimum():
    tree = hand_tree()
    plan = solve(tree, 8, ac_units=UNITS)
    assert plan.status == "optimal"
    assert plan.decisions_dict() == pytest.approx({"b0": 0.5})
    assert plan.objective_ms == pytest.approx(6.0, rel=1e-6)
    assert plan.recompute_ms == pytest.approx(6.0, rel=1e-6)
    assert plan.predicted_peak_bytes == 8 * GiB
    assert plan.baseline_peak_bytes == 10 * GiB
    assert plan.gap <= 1e-4 and plan.bound_ms <= plan.objective_ms + 1e-9
    d = plan.decisions[0]
    assert d.discard_bytes == 2 * GiB and d.saved_ops is None and d.calls == 1
    assert plan.per_module_peak == {"": 8 * GiB, "b1": 8 * GiB, "b0": 6 * GiB}


def test_min_feasible_is_computed_and_exact():
    tree = hand_tree()
    assert min_feasible_budget(tree, ac_units=UNITS) == 6 * GiB
    with pytest.raises(InfeasibleBudgetError) as ei:
        solve(tree, 6 * GiB - 1, ac_units=UNITS)
    assert ei.value.min_feasible_bytes == 6 * GiB
    assert ei.value.budget_bytes == 6 * GiB - 1
    plan = solve(tree, ei.value.min_feasible_bytes, ac_units=UNITS)
    assert plan.decisions_dict() == pytest.approx({"b0": 1.0})
    assert plan.objective_ms == pytest.approx(10.0, rel=1e-6)
    assert plan.predicted_peak_bytes == 6 * GiB


def test_no_candidates_means_infeasible_below_baseline():
    # no unit allowed: nothing can be checkpointed, the minimum is the baseline
    with pytest.raises(InfeasibleBudgetError) as ei:
        solve(hand_tree(), 9, ac_units=[])
    assert ei.value.min_feasible_bytes == 10 * GiB


def test_leaves_are_candidates_by_default():
    # the blocks of the hand tree are leaves: by default they may be checkpointed (the root may not)
    plan = solve(hand_tree(), 9)
    assert plan.decisions and all(d.fqn in UNITS for d in plan.decisions)
    assert plan.recompute_ms == pytest.approx(solve(hand_tree(), 9, ac_units=UNITS).recompute_ms)


@pytest.mark.parametrize("budget", [10, "10GiB", 10 * GiB, 12.5, "100%"])
def test_budget_at_or_above_baseline_is_an_empty_plan(budget, monkeypatch):
    def no_solver(*a, **k):  # pragma: no cover - must not be called
        raise AssertionError("the solver must not run when no checkpointing is needed")

    monkeypatch.setattr(milp_mod, "solve_model", no_solver)
    monkeypatch.setattr(budget_mod, "solve_model", no_solver)
    monkeypatch.setattr(search_mod, "solve_model", no_solver)
    plan = solve(hand_tree(), budget, ac_units=UNITS)
    assert plan.status == "not needed"
    assert plan.decisions == () and plan.recompute_ms == 0.0 and plan.solver == ""
    assert plan.predicted_peak_bytes == plan.baseline_peak_bytes == 10 * GiB


def test_world_size_scales_state():
    # 4 GiB of state at every event: at world size 4 each rank keeps 1 GiB (3 GiB shed)
    tree = hand_tree(state_bytes=4 * GiB)
    assert baseline_peak(tree) == 14 * GiB
    assert baseline_peak(tree, world_size=4) == 11 * GiB
    plan = solve(tree, 9, world_size=4, ac_units=UNITS)  # the worked example shifted by 1 GiB
    assert plan.decisions_dict() == pytest.approx({"b0": 0.5}) and plan.world_size == 4
    # a tree collected at world size 2 already holds half the state per rank
    tree2 = hand_tree(state_bytes=4 * GiB, world_size=2)
    assert baseline_peak(tree2) == 14 * GiB
    assert baseline_peak(tree2, world_size=4) == 12 * GiB
    assert baseline_peak(tree2, world_size=1) == 18 * GiB


def test_bad_arguments():
    tree = hand_tree()
    with pytest.raises(ConfigError, match="b2"):
        solve(tree, 8, ac_units=["b0", "b2"])
    with pytest.raises(ConfigError, match="did you mean"):
        solve(tree, 8, fsdp_units=["bb0"])
    with pytest.raises(ConfigError):
        solve(tree, 8, ac_units=UNITS, world_size=0)
    with pytest.raises(ConfigError):
        solve(tree, 8, ac_units="b0")
    with pytest.raises(SolverError, match="pip install"):
        solve(tree, 8, ac_units=UNITS, solver="gurobi-nope")


# --------------------------------------------------------------------------------------------------------
# structure: nesting, ac_units, fsdp_units
# --------------------------------------------------------------------------------------------------------
def _nested_tree():
    """root -> outer -> (inner_a -> leaf, inner_b -> leaf): outer, inner_a and inner_b are candidates."""
    leaf = lambda n: Spec(n, fw_ms=0.1, act=64 * MiB)  # noqa: E731
    inner = lambda n, a: Spec(n, act=a, fw_ms=2.0, lines=((1.0, 0.0),), children=[leaf("lin")])  # noqa: E731
    outer = Spec(
        "outer", act=256 * MiB, fw_ms=1.0, lines=((0.5, 0.05),),
        children=[inner("inner_a", 1024 * MiB), inner("inner_b", 1024 * MiB)],
    )
    return build_tree(Spec("model", children=[outer, Spec("head", fw_ms=0.5)], params=512 * MiB))


def test_nested_checkpointing_never_chosen():
    tree = _nested_tree()
    base = baseline_peak(tree)
    problem = SacProblem(tree)
    # every module with discardable activations, leaves included; the root only when named
    assert {c.fqn for c in problem.candidates} == {
        "outer", "outer.inner_a", "outer.inner_b", "outer.inner_a.lin", "outer.inner_b.lin"
    }
    lo = min_feasible_budget(tree)
    for frac in (0.95, 0.8, 0.6, 0.4, 0.0):
        budget = max(lo, int(base * frac))
        plan = solve(tree, budget)
        chosen = set(plan.decisions_dict())
        assert not ("outer" in chosen and chosen & {"outer.inner_a", "outer.inner_b", "outer.inner_a.lin", "outer.inner_b.lin"}), chosen
        assert not ("outer.inner_a" in chosen and "outer.inner_a.lin" in chosen), chosen
        assert not ("outer.inner_b" in chosen and "outer.inner_b.lin" in chosen), chosen
        assert plan.predicted_peak_bytes <= budget


def test_ac_units_restrict():
    tree = _nested_tree()
    budget = max(int(baseline_peak(tree) * 0.7), min_feasible_budget(tree, ac_units=["outer.inner_b"]))
    plan = solve(tree, budget, ac_units=["outer.inner_b"])
    assert set(plan.decisions_dict()) == {"outer.inner_b"}
    assert solve(tree, budget).objective_ms <= plan.objective_ms + 1e-9
    # a named leaf becomes a candidate
    plan = solve(tree, int(baseline_peak(tree) * 0.99), ac_units=["outer.inner_a.lin"], op_level=False)
    assert set(plan.decisions_dict()) == {"outer.inner_a.lin"}


def test_fsdp_units_forbid_ancestors():
    tree = _nested_tree()
    budget = max(int(baseline_peak(tree) * 0.6), min_feasible_budget(tree, fsdp_units=["outer.inner_a"]))
    free = solve(tree, budget)
    plan = solve(tree, budget, fsdp_units=["outer.inner_a"])
    assert "outer" not in plan.decisions_dict()
    assert plan.objective_ms >= free.objective_ms - 1e-9
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        kw = dict(ac_units=["outer", "outer.inner_b"], fsdp_units=["outer.inner_a"])
        plan = solve(tree, min_feasible_budget(tree, **kw), **kw)
    assert set(plan.decisions_dict()) <= {"outer.inner_b"}
    assert any("FSDP" in str(x.message) for x in w)


def test_fsdp_units_default_to_the_stats_own_fully_shard_units():
    """solve, min_feasible_budget and recompute_lower_bound read fsdp_units=None as the units the stats were sharded
    with (``meta["distributed"]["units"]``, :func:`sacplan.distributed.unit_modules`); ``[]`` is none; sac_milp keeps
    PyTorch's meaning (None: none). ``block`` holds 1 GiB, its child ``inner`` (the FSDP unit) 64 MiB: only
    ``block`` can meet a budget 1 GiB under the peak, and it may not be checkpointed around the unit."""
    import dataclasses

    from sacplan.solver import recompute_lower_bound, sac_milp
    from sacplan.tree import ModuleTree

    inner = Spec("inner", act=64 * MiB, fw_ms=5.0, lines=((1.0, 0.0),))
    block = Spec("block", act=1024 * MiB, fw_ms=1.0, lines=((1.0, 0.0),), children=[inner])
    plain = build_tree(Spec("model", children=[block, Spec("head", fw_ms=0.5, tmp=2048 * MiB)], params=512 * MiB))
    stats = plain.stats
    tree = ModuleTree(dataclasses.replace(stats, meta={**stats.meta, "distributed": {"units": [["block.inner"]]}}))
    lo = min_feasible_budget(plain)
    assert min_feasible_budget(tree, fsdp_units=[]) == lo
    # block's own 1 GiB is held at the head's peak (inner's 64 MiB is discarded either way)
    assert min_feasible_budget(tree) == min_feasible_budget(tree, fsdp_units=["block.inner"]) == lo + 1024 * MiB
    budget = int(lo + (baseline_peak(plain) - lo) // 2)
    assert solve(plain, budget).decisions_dict() == solve(tree, budget, fsdp_units=[]).decisions_dict() == {"block": 0.5}
    with pytest.raises(InfeasibleBudgetError):
        solve(tree, budget)
    with pytest.raises(InfeasibleBudgetError):
        recompute_lower_bound(tree, budget)
    assert recompute_lower_bound(tree, budget, fsdp_units=[]) == recompute_lower_bound(plain, budget) > 0
    assert sac_milp(tree, budget / GiB) == sac_milp(plain, budget / GiB) and sac_milp(tree, budget / GiB)[0]


# --------------------------------------------------------------------------------------------------------
# solvers, determinism, time limit, realisation
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_blocks", [2, 6])
@pytest.mark.parametrize("frac", [0.9, 0.7, 0.55])
@pytest.mark.parametrize("search", [True, False], ids=["milp-search", "lp-proof-allowed"])
def test_cbc_and_highs_agree(n_blocks, frac, search, monkeypatch):
    if search:  # make both back-ends run their branch-and-bound (no LP proof, no tree DP)
        monkeypatch.setattr(budget_mod, "prove_by_lp_branching", lambda *a, **k: None)
    opts = SolverOptions(gap_rel=1e-9, tree_dp=not search)
    tree = llama_tree(n_blocks)
    budget = int(baseline_peak(tree) * frac)
    try:
        a = solve(tree, budget, options=opts.replace(solver="cbc"))
    except InfeasibleBudgetError as e:
        with pytest.raises(InfeasibleBudgetError) as e2:
            solve(tree, budget, solver="highs")
        assert e.min_feasible_bytes == e2.value.min_feasible_bytes
        return
    b = solve(tree, budget, options=opts.replace(solver="highs"))
    assert a.status == b.status == "optimal"
    assert a.objective_ms == pytest.approx(b.objective_ms, rel=1e-6, abs=1e-9)
    if search:
        assert a.meta["proved_by"] == "cbc" and b.meta["proved_by"] == "highs"
    assert a.solver == "cbc" and b.solver == "highs"


def test_deterministic():
    tree = llama_tree(6)
    budget = int(baseline_peak(tree) * 0.7)
    for solver in ("cbc", "highs"):
        p1 = solve(tree, budget, solver=solver)
        p2 = solve(tree, budget, solver=solver)
        assert p1.decisions == p2.decisions
        assert p1.predicted_peak_bytes == p2.predicted_peak_bytes
        assert p1.objective_ms == p2.objective_ms


def test_time_limit_returns_best_plan_with_gap_and_warns(monkeypatch):
    real = budget_mod.solve_model
    calls = {"n": 0}

    def stopped(model, solver, **kw):
        res = real(model, solver, **kw)
        if kw.get("options") == ["preprocess off"] and any(model.col_int):  # the budget MILP's search
            calls["n"] += 1
            # what a solver reports when it stops early: the incumbent and a weaker bound
            return SolveResult(TIME_LIMIT, res.x, res.objective, res.objective * 0.9, 0.1, res.solve_s, solver, "Stopped on time")
        return res

    monkeypatch.setattr(budget_mod, "solve_model", stopped)
    monkeypatch.setattr(search_mod, "solve_model", stopped)
    monkeypatch.setattr(budget_mod, "prove_by_lp_branching", lambda *a, **k: None)  # force the MILP search
    tree = llama_tree(4)
    budget = int(baseline_peak(tree) * 0.7)
    with pytest.warns(TimeLimitWarning, match=r"gap 10\.0000%"):
        plan = solve(tree, budget, options=SolverOptions(time_limit_s=5.0, tree_dp=False))  # the MILP's search
    assert calls["n"] == 1
    assert plan.status == "time_limit" and plan.gap == pytest.approx(0.1)
    assert plan.bound_ms == pytest.approx(plan.objective_ms * 0.9)
    assert plan.predicted_peak_bytes <= budget and plan.decisions


def test_real_time_limit_on_a_larger_tree():
    tree = llama_tree(32)
    budget = int(baseline_peak(tree) * 0.8)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        plan = solve(tree, budget, solver="highs", time_limit_s=1e-4)
    # either the tiny limit stopped the search (status, gap and a warning) or it was already proven
    if plan.status == "time_limit":
        assert any(issubclass(x.category, TimeLimitWarning) for x in w)
        assert plan.gap >= 0
    else:
        assert plan.status == "optimal"
    assert plan.predicted_peak_bytes <= budget


def test_op_level_realisation():
    tree = llama_tree(4)
    budget = int(baseline_peak(tree) * 0.6)
    ratio_only = solve(tree, budget, op_level=False)
    lines = solve(tree, budget, exact=False)  # trade-off lines, each ratio realised by op selection
    assert lines.objective_ms == pytest.approx(ratio_only.objective_ms, rel=1e-9)
    assert lines.recompute_ms <= lines.objective_ms + 1e-9  # the lines bound the achievable cost from above
    plan = solve(tree, budget)  # exact: one of each module's op-level options
    assert plan.meta["exact"] is True and lines.meta["exact"] is False
    assert plan.recompute_ms == pytest.approx(plan.objective_ms, rel=1e-9)  # the model's cost is the realised one
    assert plan.objective_ms <= lines.recompute_ms + 1e-9
    for p in (plan, lines):
        assert p.predicted_peak_bytes <= budget
    problem = SacProblem(tree)
    for p in (plan, lines):
        for d in p.decisions:
            c = next(c for c in problem.candidates if c.fqn == d.fqn)
            ops = tree.node(d.fqn).stats.ops
            if d.saved_ops is not None:
                saved = {i for i, _, _ in d.saved_ops}
                assert all(not ops[i].is_view for i in saved)
                assert d.discard_bytes == c.max_discard_bytes - sum(ops[i].save_cost_bytes for i in saved)
                if p is lines:  # realised discard covers the MILP's ratio
                    assert d.discard_ratio >= ratio_only.decision(d.fqn).discard_ratio - 1e-9
            else:
                assert d.discard_ratio == 1.0 and d.recompute_ms == pytest.approx(c.calls * c.recompute_ms)


def test_plan_round_trip_and_summary():
    tree = llama_tree(3)
    plan = solve(tree, int(baseline_peak(tree) * 0.7))
    d = plan.to_dict()
    import json

    again = Plan.from_dict(json.loads(json.dumps(d)))
    assert again == plan
    text = plan.summary()
    assert "predicted" in text and "layers.0" in text and "optimal" in text
    empty = solve(tree, "100%")
    assert "no module is checkpointed" in empty.summary()
    assert Plan.from_dict(empty.to_dict()) == empty


def test_envelope_drops_redundant_lines():
    s, b = envelope([1.0, 1.0, 0.5, 2.0, -1.0], [0.0, 0.0, 0.1, -1.5, -0.5])
    # 2r - 1.5 never beats r on [0, 1]; -r - 0.5 is below q >= 0
    assert list(zip(s, b)) == [(0.5, 0.1), (1.0, 0.0)]
    for r in (0.0, 0.1, 0.2, 0.5, 1.0):
        assert max(0.0, *(x * r + y for x, y in zip(s, b))) == pytest.approx(max(0.0, 0.5 * r + 0.1, r))


def test_model_size_is_linear():
    sizes = {}
    for n in (4, 8, 16):
        tree = llama_tree(n, with_ops=False)
        problem = SacProblem(tree)
        model, idx, _ = build_budget_model(problem, baseline_peak(tree) * 0.6)
        sizes[n] = model.num_nonzeros
    # doubling the blocks roughly doubles the nonzeros (no dense per-event coefficient vectors)
    assert sizes[16] / sizes[8] < 2.3 and sizes[8] / sizes[4] < 2.3
    assert math.isfinite(sizes[16])


def test_missing_solver_package_says_how_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "highspy", None)  # import highspy -> ImportError
    with pytest.raises(SolverError, match="pip install highspy"):
        solve(hand_tree(), 8, ac_units=UNITS, solver="highs")


def test_min_feasible_budget_of_a_tiny_model_goes_straight_back_into_solve():
    """A model whose whole step is under 1 MiB: its minimum (bytes) read as GiB was a 900-TiB budget that
    needed no checkpointing; as sacplan's Bytes it is the binding budget it is."""
    import torch
    from torch import nn

    from sacplan.collector import collect
    from sacplan.tree import ModuleTree

    def block() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))

    model = nn.Sequential(nn.Linear(16, 64), *[block() for _ in range(3)], nn.Linear(64, 16))
    tree = ModuleTree(collect(model, torch.randn(64, 16), device="cpu", optimizer=False))
    lo, peak = min_feasible_budget(tree), baseline_peak(tree)
    assert lo < peak < 2**20
    plan = solve(tree, lo)
    assert plan.predicted_peak_bytes <= lo and plan.decisions  # binding: something is checkpointed
    with pytest.raises(InfeasibleBudgetError) as err:
        solve(tree, type(lo)(lo - 4096))
    assert err.value.min_feasible_bytes == lo
    assert solve(tree, err.value.min_feasible_bytes).predicted_peak_bytes <= lo
