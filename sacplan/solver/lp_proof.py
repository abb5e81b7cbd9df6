"""Proving an incumbent optimal with LP relaxations alone (:func:`prove_by_lp_branching`), before any MILP.

Branches only on integer count columns; a node is closed when its LP bound reaches the incumbent. Used by
:mod:`sacplan.solver.milp` and :mod:`sacplan.solver.compat` to skip the MILP search when the LP bounds already
prove the heuristic's plan.
"""

from __future__ import annotations

import math
import time
from typing import Sequence

from sacplan.solver.backends import solve_model
from sacplan.solver.model import INFEASIBLE, OPTIMAL, MilpModel, SolveResult, relative_gap, with_bounds


def prove_by_lp_branching(
    model: MilpModel,
    incumbent: Sequence[float] | None,
    branch_cols: Sequence[int],
    *,
    gap_rel: float,
    gap_abs: float = 1e-9,
    lp_solver: str = "highs",
    root_bound: float | None = None,
    max_nodes: int = 16,
    solver_name: str = "",
) -> SolveResult | None:
    """Try to prove ``incumbent`` optimal within the gap with LP relaxations alone, branching only on
    ``branch_cols`` (integer count columns): a node is closed when its LP bound reaches the incumbent. Returns
    an OPTIMAL result with the proven bound, or None when a node's LP is integral in those columns but still
    below the incumbent, or after ``max_nodes`` LPs (the MILP solver then takes over). Exact: nothing is
    assumed about the solution beyond the LP bounds.
    """
    if incumbent is None:
        return None
    best = model.evaluate(incumbent)
    tol = max(gap_abs, gap_rel * abs(best))
    t0 = time.perf_counter()
    closed: list[float] = []
    stack: list[tuple[dict[int, float], dict[int, float]]] = [({}, {})]
    nodes = 0
    while stack:
        lb, ub = stack.pop()
        if nodes == 0 and root_bound is not None:
            obj = root_bound
            if best - obj <= tol:
                closed.append(obj)
                nodes += 1
                continue
        sub = with_bounds(model, lb, ub)
        sub.col_int = [False] * sub.num_cols
        if nodes >= max_nodes:
            return None
        res = solve_model(sub, lp_solver)
        nodes += 1
        if res.status == INFEASIBLE:
            continue
        if res.x is None:
            return None
        if best - res.objective <= tol:
            closed.append(res.objective)
            continue
        frac = next((j for j in branch_cols if abs(res.x[j] - round(res.x[j])) > 1e-6), None)
        if frac is None:
            return None
        v = res.x[frac]
        stack.append((lb, {**ub, frac: float(math.floor(v))}))
        stack.append(({**lb, frac: float(math.ceil(v))}, ub))
    bound = min([best] + closed)
    return SolveResult(
        OPTIMAL, list(incumbent), best, bound, relative_gap(best, bound), time.perf_counter() - t0, solver_name,
        f"optimal (incumbent meets the LP bounds of {nodes} count node(s))",
    )
