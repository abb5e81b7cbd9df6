"""The min-peak plan (:func:`solve_min_peak`): the MILP whose optimum is the smallest feasible budget, and a plan that
meets it exactly in bytes; the strategy at the feasibility edge and the error's smallest feasible budget."""

from __future__ import annotations

import math
import time

import numpy as np

from sacplan.errors import InfeasibleBudgetError, SolverError
from sacplan.solver.backends import solve_model
from sacplan.solver.formulation import build_min_peak_model, columns_for, decision_from
from sacplan.solver.model import SolveResult
from sacplan.solver.options import SolverOptions
from sacplan.solver.problem import SacProblem


def solve_min_peak(
    problem: SacProblem, opts: SolverOptions, node_limit: int | None = None
) -> tuple[int, np.ndarray, np.ndarray, SolveResult, float]:
    """Solve the min-peak MILP with ``opts``' back-end and threads within ``node_limit`` branch-and-bound nodes
    (None: the call's work budget only; the wall-clock :func:`~sacplan.solver.limits.deadline` is the safety net);
    returns (ceil of the exact peak of its solution, y, r, result, build_s)."""
    t0 = time.perf_counter()
    model, idx = build_min_peak_model(problem)
    nc = problem.num_candidates
    warm = columns_for(problem, model, idx, np.zeros(nc), np.zeros(nc))
    build_s = time.perf_counter() - t0
    res = solve_model(model, opts.backend, gap_rel=1e-9, gap_abs=1e-9, threads=opts.threads, warm_start=warm,
                      node_limit=node_limit)
    if res.x is None:
        raise SolverError(f"the min-peak MILP returned no solution ({res.solver}: {res.raw_status})")
    y, _ = decision_from(problem, idx, res.x)
    # Every event only falls as a ratio grows, so for the chosen units r = 1 is optimal: the peak depends on
    # the integer choice alone and is evaluated exactly (no solver tolerance in the reported minimum).
    r = y.copy()
    peak = problem.peak(y, r)
    return int(math.ceil(peak - 1e-6)), y, r, res, build_s


def min_peak_plan(problem: SacProblem, budget: int, opts: SolverOptions) -> tuple[int, np.ndarray, np.ndarray]:
    """The min-peak plan where a strategy's own cannot stand: ``(smallest feasible budget in bytes, y, r)``;
    :class:`InfeasibleBudgetError` when it does not fit ``budget`` (bytes) either."""
    mf, y, r, _, _ = solve_min_peak(problem, opts)
    if mf > budget:
        raise InfeasibleBudgetError(budget, mf)
    return mf, y, r
