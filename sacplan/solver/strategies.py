"""The strategies, tried in order under the call's limits by :func:`find`, and the one result they give
(:class:`Found`, what the judge checks, repairs and realises):

1. the tree DP (:mod:`~sacplan.solver.tree_dp`, exact mode, few binding events): proves the optimum or gives up;
2. the chain DP (:mod:`~sacplan.solver.chain_dp`) when it gives up: exact over sequential blocks, or gives up;
3. the budget MILP (:mod:`~sacplan.solver.budget_milp`);
4. the min-peak plan (:mod:`~sacplan.solver.min_peak`): where the MILP declares a budget at the feasibility edge
   infeasible within its tolerance, or no plan fits (:class:`InfeasibleBudgetError`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np

from sacplan.errors import SolverError
from sacplan.solver import limits
from sacplan.solver.budget_milp import MilpRun, solve_budget_milp
from sacplan.solver.chain_dp import solve_chain_dp
from sacplan.solver.formulation import MilpIndex, build_budget_model, columns_for, decision_from
from sacplan.solver.model import INFEASIBLE, OPTIMAL, TIME_LIMIT, MilpModel, relative_gap
from sacplan.solver.options import SolverOptions
from sacplan.solver.problem import SacProblem
from sacplan.solver.min_peak import min_peak_plan
from sacplan.solver.tree_dp import TreeDpResult, solve_tree_dp


@dataclasses.dataclass(frozen=True)
class Found:
    """A strategy's decision: flags ``y`` and ratios ``r`` per slot, its ``objective`` and proven ``bound`` (ms of
    recompute), relative ``gap``, ``status``, its figures for ``plan.meta``, its wall seconds (``timing_s``) and the
    smallest feasible budget when a min-peak solve gave it (bytes)."""

    y: np.ndarray
    r: np.ndarray
    objective: float
    bound: float
    gap: float
    status: str
    meta: dict[str, Any]
    timing_s: dict[str, float]
    min_feasible: int | None = None


def find(problem: SacProblem, budget: int, opts: SolverOptions) -> Found:
    """The best decision the strategies find for ``budget`` bytes.

    Raises:
        InfeasibleBudgetError: no plan fits (with the smallest feasible budget).
        SolverError: the search stopped before any plan, or the back-end failed.
    """
    if problem.num_candidates == 0 or problem.lower_bound_peak() > budget:
        return _min_peak(problem, budget, opts, {}, {}, "no plan meets the budget's lower bound")
    t0 = time.perf_counter()
    model, idx, trivially_infeasible = build_budget_model(problem, float(budget))
    if trivially_infeasible:
        return _min_peak(problem, budget, opts, {}, {}, "an event exceeds the budget whatever is checkpointed")
    model_s = time.perf_counter() - t0
    why: list[str] = []
    dp = solve_tree_dp(problem, float(budget), why=why) if problem.exact and opts.tree_dp else None
    by = "tree-dp"
    if dp is None and problem.exact and opts.tree_dp and opts.chain_dp:  # many binding events: sequential blocks
        dp, by = solve_chain_dp(problem, float(budget), why=why), "chain-dp"
    dp_s = time.perf_counter() - t0 - model_s
    meta = {"model": model.stats(), "events": len(problem.ev_base), "events_kept": idx.kept_events}
    timing = {"model": model_s, "tree_dp": dp_s}
    if dp is not None:
        if by == "chain-dp":  # why the tree DP did not apply (None: not tried)
            meta["tree_dp_gave_up"] = (why or [None])[0]
        return _options_slack(problem, _from_tree_dp(problem, dp, model, idx, meta, timing, by))
    # the tree DP's reason for not applying (None: not tried, i.e. lines mode or SolverOptions(tree_dp=False)),
    # and the chain DP's when it was tried after it
    meta["tree_dp"] = (why or [None])[0]
    if len(why) > 1:
        meta["chain_dp"] = why[1]
    t1 = time.perf_counter()
    run = solve_budget_milp(problem, model, idx, float(budget), opts)
    timing.update(heuristic=run.heuristic_s, search=time.perf_counter() - t1 - run.heuristic_s)
    found = _from_milp(problem, idx, run, budget, meta, timing, opts)
    return found if found.meta.get("fallback") else _options_slack(problem, found)


def _options_slack(problem: SacProblem, found: Found) -> Found:
    """``found`` with its bound lowered by what options built past the wall-clock safety net may hide (a greedy
    fill left where an exact knapsack was due): then not proven."""
    slack = problem.options_slack_ms()
    if slack <= 0:
        return found
    found.meta["options_slack_ms"] = slack
    bound = found.bound - slack
    status = TIME_LIMIT if found.status == OPTIMAL else found.status
    return dataclasses.replace(found, bound=bound, gap=relative_gap(found.objective, bound), status=status)


def _from_tree_dp(
    problem: SacProblem, dp: TreeDpResult, model: MilpModel, idx: MilpIndex, meta: dict[str, Any],
    timing: dict[str, float], by: str,
) -> Found:
    """The DP's proven optimum (``by``: ``"tree-dp"`` or ``"chain-dp"``) as a :class:`Found`."""
    meta.update(heuristic_ms=None, raw_status=by, lp_bound_ms=None, proved_by=by,
                tree_dp={"binding_events": len(dp.binding), "max_front": max(dp.front_sizes, default=0)},
                tolerance_cuts=0)
    if by != "tree-dp":  # the chain DP's work units (deterministic)
        meta["tree_dp"]["work"] = dp.work
    # read back through the MILP's columns, as every strategy's decision is (the ratios as the options spell them)
    y, r = decision_from(problem, idx, columns_for(problem, model, idx, dp.y, dp.r))
    return Found(y, r, dp.cost_ms, dp.cost_ms, 0.0, OPTIMAL, meta, timing)


def _from_milp(
    problem: SacProblem, idx: MilpIndex, run: MilpRun, budget: int, meta: dict[str, Any], timing: dict[str, float],
    opts: SolverOptions,
) -> Found:
    """The MILP's result as a :class:`Found`; at the feasibility edge, the min-peak plan."""
    res, lp_bound = run.result, run.lp_bound
    meta.update(heuristic_ms=None if run.start is None else problem.cost(*run.start), raw_status=res.raw_status,
                lp_bound_ms=lp_bound, proved_by="lp" if run.by_lp else opts.backend, tolerance_cuts=run.cuts)
    if res.x is None:
        if res.status == INFEASIBLE:  # solver tolerance at the very edge: the min-peak solution fits exactly
            return _min_peak(problem, budget, opts, meta, timing, "the budget MILP was declared infeasible at the "
                             "feasibility edge")
        if res.status == TIME_LIMIT:
            raise SolverError(
                f"{opts.backend} stopped ({', '.join(f'{w}: {p}' for w, p in limits.stops()) or 'time limit'}) "
                f"before finding any plan (time limit {opts.time_limit_s} s, work limit {opts.work_limit} nodes); "
                "raise time_limit_s (CLI: --time-limit) or work_limit"
            )
        raise SolverError(f"{opts.backend} failed on the SAC MILP: {res.raw_status}")
    y, r = decision_from(problem, idx, res.x)
    objective, bound, gap, status = res.objective, res.bound, res.gap, res.status
    if lp_bound is not None and math.isfinite(lp_bound) and not bound >= lp_bound:
        # stopped before the search had its own bound: the root LP relaxation bounds every plan
        bound = min(objective, lp_bound)
        gap = relative_gap(objective, bound)
    return Found(y, r, objective, bound, gap, status, meta, timing)


def _min_peak(
    problem: SacProblem, budget: int, opts: SolverOptions, meta: dict[str, Any], timing: dict[str, float], why: str,
) -> Found:
    """The min-peak plan as a :class:`Found` (``why``: what ruled the strategies' own out), unproven.

    Raises:
        InfeasibleBudgetError: it does not fit ``budget`` (bytes) either (with the smallest feasible budget)."""
    mf, y, r = min_peak_plan(problem, budget, opts)
    meta["fallback"] = f"min-peak solution ({why})"
    return Found(y, r, problem.cost(y, r), -math.inf, math.inf, TIME_LIMIT, meta, timing, mf)
