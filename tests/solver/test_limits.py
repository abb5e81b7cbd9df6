"""Time limits, Ctrl-C and front thinning (issue 14): no solve runs unbounded, a stopped one says how far it is."""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
import _thread
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sacplan.errors import ConfigError
from sacplan.solver import SolverOptions, TimeLimitWarning, baseline_peak, certify, min_feasible_budget, recompute_lower_bound, sac_milp, solve
from sacplan.solver import limits
from sacplan.solver.backends import solve_model
from sacplan.solver.front import thin_front
from sacplan.solver.model import MilpModel, SolveInterrupted
from sacplan.budget_sweep import sweep
from sacplan.testing.llama_tree import llama_tree

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "soon"])
def test_bad_time_limits_are_config_errors(bad):
    tree = llama_tree(2)
    budget = int(baseline_peak(tree) * 0.8)
    calls = [
        lambda: solve(tree, budget, time_limit_s=bad),
        lambda: sweep(tree, points=2, time_limit_s=bad),
        lambda: certify(tree, budget, time_limit_s=bad),
        lambda: min_feasible_budget(tree, time_limit_s=bad),
        lambda: recompute_lower_bound(tree, budget, time_limit_s=bad),
        lambda: sac_milp(tree, f"{budget}B", time_limit_s=bad),
    ]
    for call in calls:
        with pytest.raises(ConfigError, match="time_limit_s"):
            call()


def test_check_time_limit_values():
    assert limits.check_time_limit(None) is None  # no limit only when asked for explicitly
    assert limits.check_time_limit(2) == 2.0
    assert limits.check_time_limit(math.inf) is None


def test_nested_deadlines_take_the_earlier_end():
    assert limits.remaining() is None and not limits.expired()
    with limits.deadline(10.0):
        with limits.deadline(100.0):
            assert limits.remaining() <= 10.0
            assert limits.remaining(3.0) <= 3.0
            with limits.lifted():
                assert limits.remaining() is None
        with limits.deadline(None):
            assert limits.remaining() <= 10.0
    with limits.deadline(1e-9):
        assert limits.expired()
        assert limits.remaining() == limits.MIN_SLICE_S


def test_defaults_bound_every_call():
    import inspect

    from sacplan.enable import fit_to_budget

    for fn in (solve, min_feasible_budget, recompute_lower_bound, sac_milp, fit_to_budget):
        assert inspect.signature(fn).parameters["time_limit_s"].default == limits.DEFAULT_SOLVE_S
    assert inspect.signature(sweep).parameters["time_limit_s"].default == limits.DEFAULT_SWEEP_S
    assert inspect.signature(certify).parameters["time_limit_s"].default == limits.DEFAULT_CERTIFY_S


def test_tiny_time_limit_returns_the_best_plan_with_its_gap():
    tree = llama_tree(64)
    budget = int(baseline_peak(tree) * 0.6)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        plan = solve(tree, budget, solver="highs", time_limit_s=1e-3)
    assert plan.status == "time_limit"
    assert math.isfinite(plan.gap) and plan.gap >= 0
    assert plan.bound_ms <= plan.objective_ms and plan.bound_ms > 0
    assert plan.predicted_peak_bytes <= budget and plan.decisions
    msgs = [str(x.message) for x in w if issubclass(x.category, TimeLimitWarning)]
    assert len(msgs) == 1 and "\n" not in msgs[0]
    assert "time_limit_s" in msgs[0] and "--time-limit" in msgs[0]


def test_a_solve_ends_within_its_time_limit_and_states_its_gap():
    # 64 Llama blocks at 60% of the no-AC peak: ~3.5 s for the MILP to prove on a 2-core host; stopped at 0.5 s
    # (issue 14: the phases around the MILP -- options, heuristic, realise -- once ran long past the limit). The
    # chain DP proves this one in ~0.4 s (test_chain_dp), so it is off here: the MILP's search is the subject
    tree = llama_tree(64)
    budget = int(baseline_peak(tree) * 0.6)
    limit = 0.5
    plan = _solve_within(tree, budget, limit, chain_dp=False)
    assert plan.status == "time_limit"
    assert 0 < plan.gap < 1 and plan.bound_ms < plan.objective_ms
    assert plan.predicted_peak_bytes <= budget and plan.decisions


def _market_split(seed: int = 3, rows: int = 4, cols: int = 40) -> MilpModel:
    """A market-split feasibility MILP (Cornuéjols-Dawande): tiny, and hopeless for branch-and-bound."""
    rng = random.Random(seed)
    m = MilpModel()
    for j in range(cols):
        m.add_col(f"x{j}", 0.0, 1.0, True, cost=0.0)
    for i in range(rows):
        a = [rng.randrange(100) for _ in range(cols)]
        rhs = sum(a) // 2
        m.add_row(f"r{i}", list(range(cols)), a, lb=rhs, ub=rhs)
    return m


def test_time_limit_stops_a_hopeless_milp():
    res = solve_model(_market_split(), "highs", time_limit_s=0.5)
    assert res.status in ("time_limit", "infeasible")  # infeasible only if HiGHS proves it in time
    if res.status == "time_limit":
        assert res.x is None or res.gap >= 0


def _interrupt_once_highs_runs(stop: threading.Event) -> None:
    """Ctrl-C (``interrupt_main``) 0.3 s after highspy's solver thread started: a fixed timer could land, on a
    loaded host, while the model is still being built, in C code that may take the pending interrupt for itself."""
    while not stop.is_set():
        if any("__solve" in repr(getattr(t, "_target", None)) for t in threading.enumerate()):
            if not stop.wait(0.3):
                _thread.interrupt_main()
            return
        stop.wait(0.02)


def test_ctrl_c_stops_highs_and_raises_keyboard_interrupt():
    stop = threading.Event()
    firing = threading.Thread(target=_interrupt_once_highs_runs, args=(stop,), daemon=True)
    firing.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            solve_model(_market_split(), "highs", time_limit_s=60.0)
    finally:
        stop.set()
        firing.join()


def test_deadline_caps_a_solve_model_limit():
    with limits.deadline(0.3):
        res = solve_model(_market_split(), "highs", time_limit_s=60.0)
    assert res.status in ("time_limit", "infeasible")
    assert res.solve_s < 30.0  # far below the 60 s it was asked for: the enclosing budget won


def _old_thinning(kept: list[tuple[float, float]], keep: int) -> list[tuple[float, float]]:
    """module_options' pruning before issue 14 (re-scans the front at every drop), the reference."""
    hull: list[int] = []  # lower convex hull (Andrew's monotone chain)
    for i, (x, y) in enumerate(kept):
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = kept[hull[-2]], kept[hull[-1]]
            if (x2 - x1) * (y - y1) - (y2 - y1) * (x - x1) <= 0:
                hull.pop()
            else:
                break
        hull.append(i)
    kept = list(kept)
    is_hull = [k in hull for k in range(len(kept))]
    while len(kept) > max(2, keep):
        k = min(
            range(1, len(kept) - 1),
            key=lambda k: (is_hull[k], (kept[k + 1][1] - kept[k][1]) * (kept[k][0] - kept[k - 1][0]), k),
        )
        kept.pop(k)
        is_hull.pop(k)
    return kept


@settings(max_examples=300, deadline=None)
@given(
    pts=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), min_size=0, max_size=40),
    keep=st.integers(0, 20),
)
def test_thin_front_equals_the_old_pruning(pts, keep):
    # a front: ratio strictly increasing, cost strictly increasing (integers: many exact ties in the losses)
    xs = sorted({x for x, _ in pts})
    ys = sorted({y for _, y in pts})
    n = min(len(xs), len(ys))
    front = [(xs[i] / 50.0, ys[i] / 50.0) for i in range(n)]
    assert [front[k] for k in thin_front(front, keep)] == _old_thinning(front, keep)


@pytest.mark.slow
def test_cli_ctrl_c_exits_130_without_a_partial_file(tmp_path):
    out = tmp_path / "x.json"
    env = dict(os.environ, PYTHONPATH=_ROOT)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sacplan.cli", "plan", "llama-small", "--layers", "48", "--budget", "0.5GiB",
         "--time-limit", "600", "-o", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path),
    )
    seen = []
    for line in proc.stderr:  # wait until the solver runs
        seen.append(line)
        if "solving" in line:
            break
    time.sleep(3.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    err = "".join(seen) + err
    assert proc.returncode == 130, err
    assert not out.exists()
    assert "Traceback" not in err and "interrupted" in err


def test_on_interrupt_incumbent_returns_the_best_plan_so_far(monkeypatch):
    import importlib

    budget_mod = importlib.import_module("sacplan.solver.budget_milp")

    def interrupted(*a, **k):  # Ctrl-C before the search found anything better than the heuristic's plan
        raise SolveInterrupted(None)

    monkeypatch.setattr(budget_mod, "_exact_in_bytes", interrupted)
    tree = llama_tree(8)
    budget = int(baseline_peak(tree) * 0.7)
    opts = SolverOptions(tree_dp=False)  # the MILP's search, which Ctrl-C interrupts (the DP proves this in ms)
    with pytest.raises(KeyboardInterrupt):
        solve(tree, budget, options=opts)
    plan = solve(tree, budget, options=opts.replace(on_interrupt="incumbent"))
    assert plan.status == "interrupted"
    assert plan.predicted_peak_bytes <= budget and plan.decisions
    assert plan.bound_ms <= plan.objective_ms and plan.gap >= 0
    with pytest.raises(ConfigError, match="on_interrupt"):
        solve(tree, budget, on_interrupt="ignore")


def test_options_cut_short_by_the_deadline_lower_the_bound_and_say_time_limit(monkeypatch):
    import dataclasses
    import importlib

    from sacplan.solver import SacProblem

    problem_mod = importlib.import_module("sacplan.solver.problem")
    tree = llama_tree(4)
    budget = int(baseline_peak(tree) * 0.7)
    exact = solve(tree, budget)
    assert exact.status == "optimal" and "options_slack_ms" not in exact.meta
    real = problem_mod.module_options

    def hurried(*a, **k):  # as if every option's knapsack had been left at a greedy fill within 1% of R
        return dataclasses.replace(real(*a, **k), slack_frac=0.01)

    monkeypatch.setattr(problem_mod, "module_options", hurried)
    problem = SacProblem(tree, exact=True)
    slack = sum(c.calls * c.recompute_ms * 0.01 for c in problem.candidates if problem.options(c.slot) is not None)
    assert slack > 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TimeLimitWarning)
        plan = solve(tree, budget)
    assert plan.status == "time_limit" and plan.meta["options_slack_ms"] == pytest.approx(slack)
    assert plan.objective_ms == pytest.approx(exact.objective_ms)  # same options, same plan
    assert plan.bound_ms == pytest.approx(exact.bound_ms - slack)
    assert plan.gap == pytest.approx((plan.objective_ms - plan.bound_ms) / plan.objective_ms)


def test_a_tiny_limit_still_returns_a_plan_when_no_rounding_of_the_lp_fits(monkeypatch):
    # BERT-large's lines-mode LP spreads y over nested chains so that no rounding fits: the heuristic's first
    # plan then comes from a short min-peak MILP (else a 0.5 s sweep failed: "no plan before the time limit")
    import numpy as np

    from sacplan.solver import heuristic as search

    tree = llama_tree(8)
    budget = int(baseline_peak(tree) * 0.7)
    monkeypatch.setattr(search, "_unnest", lambda problem, y: np.zeros_like(y))  # every rounding empty
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TimeLimitWarning)
        plan = solve(tree, budget, time_limit_s=1e-3, op_level=False)
    assert plan.meta["heuristic_ms"] is not None  # the warm start the search began from
    assert plan.status == "time_limit" and plan.decisions and plan.predicted_peak_bytes <= budget


def test_a_lower_bound_stopped_before_its_root_bound_is_the_lp_relaxations(monkeypatch):
    import importlib

    from sacplan.solver.model import SolveResult

    milp_mod = importlib.import_module("sacplan.solver.milp")
    tree = llama_tree(8)
    budget = int(baseline_peak(tree) * 0.6)
    proven = recompute_lower_bound(tree, budget)
    real = milp_mod.solve_model

    def no_root_bound(model, solver, **kw):  # the MILP stopped at its limit before its root bound (GPT-2 XL, 0.5 s)
        if any(model.col_int):
            return SolveResult("time_limit", None, math.inf, -math.inf, math.inf, 0.5, solver, "time limit")
        return real(model, solver, **kw)

    monkeypatch.setattr(milp_mod, "solve_model", no_root_bound)
    weak = recompute_lower_bound(tree, budget, time_limit_s=0.5)
    assert 0 < weak <= proven + 1e-9  # valid: below the proven bound, and not the trivial 0


def test_a_large_stage_module_does_not_spend_the_limit_on_its_options():
    """A module holding 300 small blocks (600 free op groups, more than the DP takes) is offered options at its
    601 trade-off ratios, each an exact knapsack: one MILP apiece took 11 s before the first MILP of the plan
    could start, under a 0.5 s limit (issue 14: Mistral-7B's decoder stack, 23 s). Exact fills need no MILP;
    past the deadline a fractional one keeps its greedy fill, its LP slack deducted from the stated bound."""
    from sacplan.testing.synthetic import Spec, build_tree, op_stat

    mib = 2**20
    ops = []
    for b in range(300):  # mixed sizes and times: some ratios need a true knapsack
        ops.append(op_stat(2 * b, "aten.mm.default", b, (1 + b % 3) * mib, 3.0 + (b % 5) * 0.5))
        ops.append(op_stat(2 * b + 1, "aten.gelu.default", b, 2 * mib, 2.0))
    A = sum(o.save_cost_bytes for o in ops)
    stage = Spec("stage", act=A, ops=tuple(ops), fw_ms=sum(o.runtime_ms for o in ops))
    tree = build_tree(Spec("", children=[stage, Spec("head", act=A, tmp=A, no_tradeoff=True)]))
    lo, base = min_feasible_budget(tree), baseline_peak(tree)
    assert lo < base
    budget = lo + (base - lo) // 2
    limit = 0.5
    plan = _solve_within(tree, budget, limit)
    assert plan.status in ("optimal", "time_limit") and plan.decisions and plan.predicted_peak_bytes <= budget
    assert 0 <= plan.gap < 1 and plan.bound_ms <= plan.objective_ms + 1e-9


def test_progress_inside_a_sub_problem_shows_the_whole_search() -> None:
    """A leaf MILP's own bound is no bound of the search: lines inside ``within`` show the search's figures
    (the smaller incumbent, the smaller bound), so the bound never seems to jump up and down."""
    import io

    from sacplan.solver import limits, progress

    out = io.StringIO()
    with progress.progress_to(out), limits.deadline(None):
        progress.report(10.0, 8.0, 0.2, force=True)
        with progress.within(9.5, 8.5):
            progress.report(10.0, 9.0, 0.1, force=True)  # leaf: worse incumbent, its own (higher) bound
        with progress.within(11.0, 7.0):
            progress.report(10.0, 9.0, 0.1, force=True)
    lines = out.getvalue().splitlines()
    assert "best 10.0000 ms, bound 8.0000 ms, gap 20.000%" in lines[0]
    assert "best 9.5000 ms, bound 8.5000 ms, gap 10.526%" in lines[1]
    assert "best 10.0000 ms, bound 7.0000 ms, gap 30.000%" in lines[2]


def _solve_within(tree, budget, limit: float, chain_dp: bool = True):
    """``solve`` under ``limit`` seconds (its time-limit warning silenced), asserting it ended within 10x limit + 5 s
    (wide slack: a loaded 2-core host; the status "time_limit" is what shows the limit was applied)."""
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TimeLimitWarning)
        plan = solve(tree, budget, options=SolverOptions(time_limit_s=limit, chain_dp=chain_dp))
    took = time.perf_counter() - t0
    assert took <= 10 * limit + 5.0, f"solve took {took:.1f} s under a {limit} s limit"
    return plan

