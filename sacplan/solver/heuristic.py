"""The heuristic incumbent of the budget MILP (:func:`heuristic`), each decision checked and repaired in exact
bytes (:func:`~sacplan.solver.repair.repair`)."""

from __future__ import annotations

import math
import time
from typing import Iterator, Sequence

import numpy as np

from sacplan.errors import SolverError
from sacplan.solver import limits
from sacplan.solver.backends import lp_solver, solve_model
from sacplan.solver.descent import improve
from sacplan.solver.formulation import MilpIndex, decision_from, fix_y
from sacplan.solver.limits import lifted
from sacplan.solver.min_peak import solve_min_peak
from sacplan.solver.model import MilpModel, relaxed
from sacplan.solver.options import SolverOptions
from sacplan.solver.problem import SacProblem
from sacplan.solver.repair import repair


#: Branch-and-bound nodes the heuristic may spend on a min-peak MILP for its first plan when its roundings all
#: fail (deterministic; drawn from the call's work budget)
FIRST_PLAN_NODES = 1_000


def heuristic(
    problem: SacProblem, model: MilpModel, idx: MilpIndex, budget: float, opts: SolverOptions
) -> tuple[tuple[np.ndarray, np.ndarray] | None, float | None]:
    """A feasible (y, r) from the LP relaxation (round y, fix it, re-solve the LP over the ratios; exact mode:
    round the option levels, then the local descent of :func:`~sacplan.solver.descent.improve`), and the LP
    relaxation's objective (a lower bound, ms). Deterministic: a fixed sequence of LPs, a min-peak MILP of at most
    :data:`FIRST_PLAN_NODES` nodes, a bounded descent; the wall-clock safety net only ends the LPs after the first
    plan and the descent, recorded."""
    if problem.num_candidates == 0:
        return None, None
    with lifted():  # LPs only: the first plan comes even from a spent time budget
        first, lp_bound = _heuristic(problem, model, idx, budget, opts, limits.remaining())
    if first is not None and problem.exact:  # under the call's limits again: the safety net can end the descent
        first = improve(problem, first[0], first[1], budget)
    return first, lp_bound


def _heuristic(
    problem: SacProblem, model: MilpModel, idx: MilpIndex, budget: float, opts: SolverOptions,
    left: float | None = None,
) -> tuple[tuple[np.ndarray, np.ndarray] | None, float | None]:
    t0 = time.monotonic()
    solver, threads = lp_solver(opts.backend), opts.threads
    lp = relaxed(model)
    res = solve_model(lp, solver, threads=threads)
    if res.x is None:
        return None, None
    lp_bound = res.objective
    yl = np.array([res.x[j] for j in idx.y])
    best: tuple[float, np.ndarray, np.ndarray] | None = None

    def units() -> Iterator[np.ndarray]:
        # Candidate roundings: thresholds on the LP's y; nesting conflicts resolved by keeping the outermost unit.
        for thr in (1e-6, 0.25, 0.5, 0.75):
            if best is not None and left is not None and time.monotonic() - t0 >= left:
                limits.stopped(limits.WALL_CLOCK, "heuristic")  # safety net: a plan in hand, the clock spent
                return
            yield _unnest(problem, (yl > thr).astype(float))
        if best is None:  # none fits (the LP spread y over nested chains): the units of a min-peak plan
            try:
                yield solve_min_peak(problem, opts.replace(solver=solver), node_limit=FIRST_PLAN_NODES)[1]
            except SolverError:
                return

    for y in units():
        if not y.any():
            continue
        fixed = fix_y(model, idx, y)
        sub = solve_model(fixed, solver, threads=threads)
        if sub.x is None:
            continue
        y2, r2 = decision_from(problem, idx, sub.x)
        if idx.w:
            r2 = _round_up(problem, idx, sub.x, y2)
        # drop checkpoints the LP left unused: r = 0 only costs the intercept and adds recompute extras
        y2[r2 <= 1e-12] = 0.0
        r2 = repair(problem, y2, r2 * y2, budget)
        if r2 is None:
            continue
        val = problem.cost(y2, r2)
        if best is None or val < best[0] - 1e-12:
            best = (val, y2, r2)
    if best is None:
        return None, lp_bound
    return (best[1], best[2]), lp_bound


def _unnest(problem: SacProblem, y: np.ndarray) -> np.ndarray:
    """Keep, along every candidate chain, only the outermost flagged node: a flagged node with a flagged ancestor is
    dropped (the outermost flagged node of a chain has none, so the result does not depend on any walk order)."""
    return np.array([0.0 if any(y[p] > 0.5 for p in problem.ancestors(s)) else y[s]
                     for s in range(problem.num_candidates)])


def _round_up(problem: SacProblem, idx: MilpIndex, x: Sequence[float], y: np.ndarray) -> np.ndarray:
    """Exact-mode ratios from a fractional LP solution ``x`` (``y`` fixed) discarding at least what the LP does at
    every event. A module alone takes the next option at or above its LP level. In a class of identical sequential
    blocks the LP's counts per level ``N_k = Σ w_{i,k}`` (checkpointed members) are rounded up and given to the
    earliest members: every prefix of the forward order, what any fw or bw event counts, then discards
    ``Σ_k Δr_k · min(p, ⌈N_k⌉)``, at least the LP's, and one member per level and class pays for the rounding."""
    r = np.zeros(problem.num_candidates)
    done: set[int] = set()
    for _, members in problem.classes():
        if len(members) < 2 or members[0] not in idx.w:
            continue
        seq = problem.sequential(members)
        if seq is None:
            continue
        on = [s for s in seq if y[s] > 0.5]
        o = problem.options(members[0])
        assert o is not None
        counts = [math.ceil(sum(x[idx.w[s][k]] for s in on) - 1e-6) for k in range(len(idx.w[members[0]]))]
        for i, s in enumerate(on):
            r[s] = o.ratio[sum(1 for n in counts if i < n)]
        done.update(members)
    for c in problem.candidates:
        s = c.slot
        if s in done or y[s] < 0.5:
            continue
        o = problem.options(s)
        if o is None or s not in idx.w:
            r[s] = min(1.0, max(0.0, x[idx.r[s]]))
        else:
            r[s] = o.ratio[sum(1 for j in idx.w[s] if x[j] > 1e-6)]
    return r
