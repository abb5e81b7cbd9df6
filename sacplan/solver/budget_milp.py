"""The MILP strategy (:func:`solve_budget_milp`): the heuristic's incumbent, then an LP proof of it or the
back-end's branch-and-bound (class counts branched first), then no-good cuts over solutions a solver's tolerance let
a few bytes over the budget; Ctrl-C returns the best plan so far when ``on_interrupt="incumbent"``.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from sacplan.solver import limits
from sacplan.solver.backends import solve_model
from sacplan.solver.formulation import MilpIndex, columns_for, decision_from
from sacplan.solver.count_branching import prove_by_lp_branching
from sacplan.solver.model import (
    OPTIMAL, TIME_LIMIT, MilpModel, SolveInterrupted, SolveResult, interrupted_result,
)
from sacplan.solver.options import SolverOptions
from sacplan.solver.problem import SacProblem
from sacplan.solver.heuristic import heuristic

#: rounds of no-good cuts before the judge's ratio repair takes over
MAX_CUTS = 32


@dataclasses.dataclass(frozen=True)
class MilpRun:
    """The back-end's (or LP proof's) ``result``, the no-good ``cuts`` added, whether the LP bounds alone proved it,
    the heuristic's incumbent (y, r) or None, the LP relaxation's objective (ms) and the heuristic's seconds."""

    result: SolveResult
    cuts: int
    by_lp: bool
    start: tuple[np.ndarray, np.ndarray] | None
    lp_bound: float | None
    heuristic_s: float


def solve_budget_milp(
    problem: SacProblem, model: MilpModel, idx: MilpIndex, budget: float, opts: SolverOptions
) -> MilpRun:
    """The budget MILP ``model`` (:func:`~sacplan.solver.formulation.build_budget_model` at ``budget`` bytes)
    solved from the heuristic's incumbent; see the module docstring."""
    t0 = time.perf_counter()
    start, lp_bound = heuristic(problem, model, idx, budget, opts)
    heuristic_s = time.perf_counter() - t0
    warm = columns_for(problem, model, idx, *start) if start is not None else None
    try:
        res, cuts, by_lp = _exact_in_bytes(problem, model, idx, warm, budget, opts, lp_bound)
    except SolveInterrupted as e:
        if opts.on_interrupt != "incumbent":
            raise
        res, cuts, by_lp = interrupted_result(e.result, model, warm, opts.backend), 0, False
    return MilpRun(res, cuts, by_lp, start, lp_bound, heuristic_s)


def _exact_in_bytes(
    problem: SacProblem, model: MilpModel, idx: MilpIndex, warm: list[float] | None, budget: float,
    opts: SolverOptions, lp_bound: float | None,
) -> tuple[SolveResult, int, bool]:
    """Solve the budget MILP, in exact mode to exactness in bytes: (result, cuts added, whether the LP bounds alone
    proved it).

    A solver accepts rows violated by up to its feasibility tolerance (~1e-9 GiB, about a byte), so at a budget
    met with equality it may return a plan a few bytes over. In exact mode the binary columns (``y``, levels
    ``w``) fix every column, so a no-good cut over them, ``Σ_{x_j=0} x_j + Σ_{x_j=1} (1 - x_j) ≥ 1``, removes
    exactly that assignment, and the model is solved again: the optimum over exactly feasible plans, proven
    (repairing a ratio instead jumps to a dearer option, or to the min-peak plan). CBC runs with preprocessing
    off: on budgets met with equality it has cut off the optimum (a 3-module tree: 25.912 ms "optimal" against
    22.994 ms, also by brute force).
    """
    binaries = (idx.y + [j for cols in idx.w.values() for j in cols]) if problem.exact else []
    # branch on class counts first (CBC's preprocessing would substitute the count columns away), then on how
    # many members of a class reach each option level: llama-small x48 at 0.5 GiB, gap 5.8e-4 after 500 s without
    # the level counts, proven in ~15 s with them (issue 14)
    priorities = {**{k: 1 for k in idx.K}, **{n: 2 for n, _, _ in idx.N}}
    cuts = 0
    while True:
        res, by_lp = prove_or_search(model, warm, priorities, opts, lp_bound if not cuts else None)
        if res.x is None or not binaries or cuts >= MAX_CUTS:
            return res, cuts, by_lp
        y, r = decision_from(problem, idx, res.x)
        if math.ceil(problem.peak(y, problem.snap(y, r)) - 1e-6) <= budget:
            return res, cuts, by_lp
        if limits.nodes_left() == 0 or limits.past_deadline("no-good cuts"):
            # no work left for another round: the judge repairs the few bytes over, unproven
            if res.status == OPTIMAL:
                res = dataclasses.replace(res, status=TIME_LIMIT)
            return res, cuts, False
        ones = [j for j in binaries if res.x[j] > 0.5]
        zeros = [j for j in binaries if res.x[j] <= 0.5]
        model.add_row(f"cut{cuts}", zeros + ones, [1.0] * len(zeros) + [-1.0] * len(ones), lb=1.0 - len(ones))
        cuts += 1


def prove_or_search(
    model: MilpModel, warm: list[float] | None, priorities: dict[int, int], opts: SolverOptions,
    root_bound: float | None,
) -> tuple[SolveResult, bool]:
    """``model`` solved from the incumbent ``warm``, proven by LP bounds alone branching on the ``priorities``
    columns (:func:`~sacplan.solver.count_branching.prove_by_lp_branching`; ``root_bound``: the LP relaxation's
    objective, ms, when known), else by the back-end, those columns branched first; and whether the LPs proved it."""
    proven = prove_by_lp_branching(
        model, warm, list(priorities), gap_rel=opts.gap_rel, root_bound=root_bound, backend=opts.backend)
    if proven is not None:
        return proven, True
    # CBC preprocessing has cut off optima at budgets met with equality (see _exact_in_bytes)
    return solve_model(model, opts.backend, gap_rel=opts.gap_rel, gap_abs=1e-7, threads=opts.threads, warm_start=warm,
                       priorities=priorities or None, options=["preprocess off"]), False
