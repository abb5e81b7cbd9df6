"""SolverOptions: every solver setting in one validated object, accepted by every public solving call."""

from __future__ import annotations

import warnings

import pytest

import sacplan
from sacplan.errors import ConfigError, SolverError
from sacplan.solver import SolverOptions, certify, min_feasible_budget, recompute_lower_bound, sac_milp, solve
from sacplan.solver.options import resolve_options
from sacplan.budget_sweep import sweep
from sacplan.testing.llama_tree import llama_tree


@pytest.mark.parametrize(
    "kwargs, says",
    [
        (dict(gap_rel=1.0), "gap_rel"),
        (dict(gap_rel=-1e-3), "gap_rel"),
        (dict(gap_rel="tight"), "gap_rel"),
        (dict(threads=0), "threads"),
        (dict(threads=True), "threads"),
        (dict(max_options=0), "max_options"),
        (dict(max_options=2.5), "max_options"),
        (dict(on_interrupt="ignore"), "on_interrupt"),
        (dict(time_limit_s=0), "time_limit_s"),
        (dict(time_limit_s=float("nan")), "time_limit_s"),
    ],
)
def test_bad_settings_are_config_errors_naming_the_field(kwargs, says):
    with pytest.raises(ConfigError, match=says):
        SolverOptions(**kwargs)


def test_unknown_solver_is_a_solver_error_saying_what_to_use():
    with pytest.raises(SolverError, match="'auto'"):
        SolverOptions(solver="gurobi")


def test_backend_exact_mode_and_replace():
    o = SolverOptions(solver="cbc", time_limit_s=float("inf"))
    assert o.backend == "cbc" and o.time_limit_s is None  # infinite: no limit
    assert SolverOptions().exact_mode and not SolverOptions(exact=False).exact_mode
    assert not SolverOptions(op_level=False).exact_mode and not SolverOptions(op_level=False, exact=True).exact_mode
    assert o.replace(gap_rel=0.0).gap_rel == 0.0 and o.gap_rel == 1e-4  # frozen: a copy
    with pytest.raises(ConfigError, match="threads"):
        o.replace(threads=-2)
    assert sacplan.SolverOptions is SolverOptions


def test_keywords_and_options_are_one_or_the_other():
    opts = SolverOptions(solver="cbc")
    assert resolve_options(opts, dict(solver="auto", time_limit_s=60.0)) is opts  # keywords at their defaults
    assert resolve_options(None, dict(solver="cbc", gap_rel=0.01)).gap_rel == 0.01
    assert resolve_options(None, {}, time_limit_default=300.0).time_limit_s == 300.0
    with pytest.raises(ConfigError, match="gap_rel, solver given both"):
        resolve_options(opts, dict(solver="highs", gap_rel=0.5))
    with pytest.raises(ConfigError, match="SolverOptions, got dict"):
        resolve_options({"solver": "cbc"}, {})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tree():
    return llama_tree(2)


def test_every_public_call_takes_options_and_rejects_both_ways(tree):
    budget = int(sacplan.baseline_peak(tree) * 0.8)
    opts = SolverOptions(solver="cbc", time_limit_s=30)
    calls = {
        "solve": lambda **kw: solve(tree, budget, **kw),
        "min_feasible_budget": lambda **kw: min_feasible_budget(tree, **kw),
        "recompute_lower_bound": lambda **kw: recompute_lower_bound(tree, budget, **kw),
        "certify": lambda **kw: certify(tree, budget, **kw),
        "sweep": lambda **kw: sweep(tree, points=2, **kw),
        "sac_milp": lambda **kw: sac_milp(tree, budget / 2**30, **kw),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, call in calls.items():
            assert call(options=opts) is not None, name
            with pytest.raises(ConfigError, match="solver given both"):
                call(options=opts, solver="highs")


def test_options_give_the_plan_the_keywords_give(tree):
    budget = int(sacplan.baseline_peak(tree) * 0.7)
    a = solve(tree, budget, solver="cbc", max_options=4, gap_rel=1e-6)
    b = solve(tree, budget, options=SolverOptions(solver="cbc", max_options=4, gap_rel=1e-6))
    assert a.solver == b.solver == "cbc"
    assert [(d.fqn, d.discard_bytes) for d in a.decisions] == [(d.fqn, d.discard_bytes) for d in b.decisions]
    assert a.recompute_ms == b.recompute_ms and a.predicted_peak_bytes == b.predicted_peak_bytes
    # ratio-only through options, as through op_level=False
    c = solve(tree, budget, options=SolverOptions(op_level=False))
    assert c.meta["op_level"] is False and all(d.saved_ops is None for d in c.decisions)
