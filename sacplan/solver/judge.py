"""The one judge of every strategy's decision, on the Timeline (:func:`judge`): exact bytes, repair, realisation;
its :class:`Verdict` is what the :class:`~sacplan.plan.Plan` reports."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from sacplan.errors import SolverError
from sacplan.plan import ModuleDecision
from sacplan.solver.model import TIME_LIMIT, relative_gap
from sacplan.solver.options import SolverOptions
from sacplan.solver.problem import SacProblem
from sacplan.solver.realise import realise
from sacplan.solver.min_peak import min_peak_plan
from sacplan.solver.repair import repair
from sacplan.solver.strategies import Found


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The judged plan: its module ``decisions``, every event's realised bytes (``peaks``) and their maximum
    rounded up (``predicted_peak_bytes``), the objective and gap as the judged plan costs them (ms; an unproven
    plan's objective may rise in repair), the smallest feasible budget when a min-peak solve gave it (bytes), the
    model's recompute ms of the judged (y, r), and why the min-peak plan replaced the strategy's (or None)."""

    decisions: tuple[ModuleDecision, ...]
    peaks: np.ndarray
    predicted_peak_bytes: int
    objective: float
    gap: float
    min_feasible: int | None
    model_recompute_ms: float
    fallback: str | None


def judge(problem: SacProblem, found: Found, budget: int, opts: SolverOptions) -> Verdict:
    """``found`` checked at ``budget`` in exact bytes and repaired where a solver's tolerance let it a few bytes
    over (:func:`~sacplan.solver.repair.repair` only raises ratios; the min-peak plan where nothing can), its
    ratios snapped to the next exact option, checkpoints that discard nothing dropped, then realised as op save
    lists (:func:`~sacplan.solver.realise.realise`) and the realised peak re-checked.

    Raises:
        InfeasibleBudgetError: the decision violates the budget beyond repair and no plan fits.
    """
    y, r, min_feasible, fallback = found.y, found.r, found.min_feasible, None
    r_fixed = repair(problem, y, r, float(budget))
    if r_fixed is None:
        mf, y, r = min_peak_plan(problem, budget, opts)
        fallback, min_feasible = "min-peak solution (the solver's plan violated the budget beyond repair)", mf
    else:
        r = r_fixed
    r = problem.snap(y, r)  # exact mode: repaired ratios up to the next option (discards only grow)
    # a checkpoint that discards nothing only adds its recompute transient: drop it (every event falls or stays)
    y = np.where(r <= 1e-12, 0.0, y)
    r = r * y
    objective, gap = found.objective, found.gap
    if found.status == TIME_LIMIT and math.isfinite(objective):  # unproven: state what the plan returned costs
        objective = max(objective, problem.cost(y, r))  # (a repair above may have raised it past the solver's)
        gap = relative_gap(objective, found.bound)
    if not problem.nesting_ok(y):  # pragma: no cover - guaranteed by the constraints
        raise SolverError("internal error: the solver returned nested checkpoint units")
    model_ms = problem.cost(y, r)
    decisions, y_real, r_real = realise(problem, y, r, opts)
    m = problem.peaks(y_real, r_real)
    predicted = int(math.ceil(float(np.max(m)) - 1e-6))
    if predicted > budget:  # pragma: no cover - realised discards only ever grow
        raise SolverError(f"internal error: realised plan peaks at {predicted} > budget {budget}")
    return Verdict(tuple(decisions), m, predicted, objective, gap, min_feasible, model_ms, fallback)
