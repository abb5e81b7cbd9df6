"""The HiGHS back-end: HiGHS through ``highspy`` directly (the matrix is passed in one call).

HiGHS has no branching priorities: :func:`branch_on_priorities` branches on the priority columns itself and
solves each leaf with HiGHS's MILP (CBC reads priorities natively, see :mod:`sacplan.solver.cbc`).
Deterministic: one thread unless asked otherwise, fixed random seed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from typing import Any, Mapping

import numpy as np

from sacplan.errors import SolverError
from sacplan.solver import limits
from sacplan.solver.model import (
    ERROR,
    INF,
    INFEASIBLE,
    OPTIMAL,
    TIME_LIMIT,
    MilpModel,
    RunSettings,
    SolveResult,
    relative_gap,
    with_bounds,
)

#: True once this process has built a ``highspy.Highs`` (its banner is printed only then)
_HIGHS_STARTED = False


def _new_highs() -> Any:
    """A ``highspy.Highs``; the first of a process is built with file descriptor 1 pointed at /dev/null, since
    HiGHS prints its banner from C++ on first construction, before ``output_flag`` can be set (it would land
    in the middle of the CLI's plan, or in a user's own output)."""
    global _HIGHS_STARTED
    import highspy

    if _HIGHS_STARTED:
        return highspy.Highs()
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):  # no real stdout (embedded interpreters): let it print
        _HIGHS_STARTED = True
        return highspy.Highs()
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        h = highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)
    _HIGHS_STARTED = True
    return h


def solve_highs(model: MilpModel, run: RunSettings, highs_options: Mapping[str, Any] | None = None) -> SolveResult:
    """Solve ``model`` with in-process HiGHS under ``run`` (``highs_options``: extra HiGHS options)."""
    import highspy

    time_limit_s, gap_rel, gap_abs, threads, warm_start, feas_tol = run.fields()

    h = _new_highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("random_seed", 1)
    h.setOptionValue("threads", int(threads) if threads else 1)
    h.setOptionValue("mip_rel_gap", float(gap_rel))
    h.setOptionValue("mip_abs_gap", float(gap_abs))
    h.setOptionValue("primal_feasibility_tolerance", max(feas_tol, 1e-10))
    h.setOptionValue("mip_feasibility_tolerance", max(feas_tol, 1e-10))
    if time_limit_s is not None:
        h.setOptionValue("time_limit", max(0.01, float(time_limit_s)))
    if run.node_limit is not None:
        h.setOptionValue("mip_max_nodes", max(1, int(run.node_limit)))
    for k, v in (highs_options or {}).items():
        h.setOptionValue(k, v)
    inf = highspy.kHighsInf
    lp = highspy.HighsLp()
    lp.num_col_ = model.num_cols
    lp.num_row_ = model.num_rows
    lp.col_cost_ = np.asarray(model.col_cost, dtype=float)
    lp.col_lower_ = np.asarray([(-inf if v == -INF else v) for v in model.col_lb], dtype=float)
    lp.col_upper_ = np.asarray([(inf if v == INF else v) for v in model.col_ub], dtype=float)
    lp.row_lower_ = np.asarray([(-inf if v == -INF else v) for v in model.row_lb], dtype=float)
    lp.row_upper_ = np.asarray([(inf if v == INF else v) for v in model.row_ub], dtype=float)
    lp.offset_ = float(model.obj_offset)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_ = model.num_cols
    lp.a_matrix_.num_row_ = model.num_rows
    lp.a_matrix_.start_ = np.asarray(model.row_start, dtype=np.int32)
    lp.a_matrix_.index_ = np.asarray(model.row_index, dtype=np.int32)
    lp.a_matrix_.value_ = np.asarray(model.row_value, dtype=float)
    if any(model.col_int):
        lp.integrality_ = [
            highspy.HighsVarType.kInteger if b else highspy.HighsVarType.kContinuous for b in model.col_int
        ]
    # kWarning is returned for valid models with tiny coefficients (HiGHS drops them); only kError is fatal.
    if h.passModel(lp) == highspy.HighsStatus.kError:
        raise SolverError("HiGHS rejected the model (passModel failed)")
    if warm_start is not None:
        sol = highspy.HighsSolution()
        sol.col_value = [float(v) for v in warm_start]
        sol.value_valid = True
        h.setSolution(sol)
    t0 = time.perf_counter()
    interrupted = limits.run_highs(h)
    solve_s = time.perf_counter() - t0
    ms = h.getModelStatus()
    info = h.getInfo()
    raw = h.modelStatusToString(ms)
    has_x = info.primal_solution_status == 2  # kSolutionStatusFeasible
    x = list(h.getSolution().col_value) if has_x else None
    objective = model.evaluate(x) if x is not None else INF
    mip = any(model.col_int)
    if (
        not interrupted
        and mip
        and ms == highspy.HighsModelStatus.kOptimal
        and warm_start is not None
        and x is not None
        and objective - float(info.objective_function_value) > max(gap_abs, 1e-9 * max(1.0, abs(objective)))
    ):
        # HiGHS 1.16 can report a better MIP objective than the solution vector it returns, which is then the
        # warm start handed in (seen when presolve settles the model): the better vector is lost, so solve again
        # without the warm start.
        res = solve_highs(model, dataclasses.replace(run, warm_start=None), highs_options)
        return dataclasses.replace(res, solve_s=res.solve_s + solve_s, log="HiGHS re-run without the warm start: its "
                                   "solution vector was the warm start, not the better objective it reported")
    if ms == highspy.HighsModelStatus.kOptimal:
        status = OPTIMAL
        bound = float(info.mip_dual_bound) if mip else objective
        bound = min(bound, objective)
    elif ms == highspy.HighsModelStatus.kInfeasible:
        status, x, objective, bound = INFEASIBLE, None, INF, INF
    elif ms in (highspy.HighsModelStatus.kTimeLimit, highspy.HighsModelStatus.kInterrupt,
                highspy.HighsModelStatus.kSolutionLimit, highspy.HighsModelStatus.kIterationLimit):
        status = TIME_LIMIT
        bound = float(info.mip_dual_bound) if mip else -INF
        if x is not None:
            bound = min(bound, objective)
    else:
        status, bound = (TIME_LIMIT if x is not None else ERROR), (float(info.mip_dual_bound) if mip else -INF)
    gap = relative_gap(objective, bound) if x is not None else INF
    stopped_by = ""
    if ms in (highspy.HighsModelStatus.kSolutionLimit, highspy.HighsModelStatus.kIterationLimit):
        stopped_by = limits.WORK_LIMIT  # mip_max_nodes: counted, the same on every run
    elif ms == highspy.HighsModelStatus.kTimeLimit:
        stopped_by = limits.WALL_CLOCK
    nodes = int(info.mip_node_count) if mip and int(info.mip_node_count) > 0 else 0
    res = SolveResult(status, x, objective, bound, gap, solve_s, "highs", raw, nodes=nodes, stopped_by=stopped_by)
    if interrupted:
        raise limits.SolveInterrupted(res)
    return res


def branch_on_priorities(
    model: MilpModel,
    priorities: Mapping[int, int],
    run: RunSettings,
    highs_options: Mapping[str, Any] | None,
    max_nodes: int = 64,
) -> SolveResult:
    """HiGHS has no branching priorities: branch on the priority columns here (depth first, LP bounds),
    then solve each leaf (all priority columns integral in its LP) with HiGHS's MILP under the incumbent as
    cutoff. Exact: the returned bound is the minimum over pruned and solved leaves.

    Used for the count columns of repeated blocks, whose LP relaxation is weak only in *how many* blocks
    are checkpointed: once that count is fixed the LP bound is (nearly) tight.
    """
    time_limit_s, gap_rel, gap_abs, threads, warm_start, feas_tol = run.fields()
    t0 = time.perf_counter()
    order = sorted(priorities, key=lambda j: (priorities[j], j))
    best_x = list(warm_start) if warm_start is not None else None
    best = model.evaluate(best_x) if best_x is not None and model.max_violation(best_x) <= 1e-6 else INF
    if best == INF:
        best_x = None
    leaf_bounds: list[float] = []
    stop = [""]  # what cut the search short: "" or limits.WORK_LIMIT / limits.WALL_CLOCK
    nodes = 0  # LPs solved here plus the leaf MILPs' nodes: the work charged (deterministic)
    # entries: (lower bounds, upper bounds, LP bound of the parent node)
    stack: list[tuple[dict[int, float], dict[int, float], float]] = [({}, {}, -INF)]
    hopts = dict(highs_options or {})

    def left() -> float | None:
        own = None if time_limit_s is None else time_limit_s - (time.perf_counter() - t0)
        end = limits.remaining()
        return own if end is None else (end if own is None else min(own, end))

    def nodes_left() -> int | None:
        return None if run.node_limit is None else max(0, run.node_limit - nodes)

    def out_of_work() -> bool:
        """The node budget is spent (deterministic) or the wall clock ran out (safety net): record which."""
        n, rem = nodes_left(), left()
        if n is not None and n <= 0:
            stop[0] = stop[0] or limits.WORK_LIMIT
            return True
        if (rem is not None and rem <= 0) or limits.expired():
            stop[0] = limits.WALL_CLOCK
            return True
        return False

    def summary() -> SolveResult:
        solve_s = time.perf_counter() - t0
        if best_x is None:
            if stop[0]:
                return SolveResult(TIME_LIMIT, None, INF, -INF, INF, solve_s, "highs", stop[0], nodes=nodes,
                                   stopped_by=stop[0])
            return SolveResult(INFEASIBLE, None, INF, INF, INF, solve_s, "highs", "Infeasible", nodes=nodes)
        bound = min([best] + leaf_bounds + [b for _, _, b in stack])
        gap = relative_gap(best, bound)
        cut = bool(stop[0]) and gap > gap_rel
        status = TIME_LIMIT if cut else OPTIMAL
        return SolveResult(status, best_x, best, bound, gap, solve_s, "highs", f"{status} ({nodes} count nodes)",
                           nodes=nodes, stopped_by=stop[0] if cut else "")

    def prune_at(v: float) -> bool:
        return best < INF and v >= best - max(gap_abs, gap_rel * abs(best))

    while stack:
        lb, ub, parent_bound = stack.pop()
        if nodes > 0 and out_of_work():
            leaf_bounds.append(parent_bound)
            continue
        rem = left()
        sub = with_bounds(model, lb, ub)
        relax = MilpModel(**{k: (list(v) if isinstance(v, list) else v) for k, v in sub.__dict__.items()})
        relax.col_int = [False] * relax.num_cols
        try:
            lp = solve_highs(relax, RunSettings(rem, 0.0, 0.0, threads, None, feas_tol))
        except limits.SolveInterrupted:
            stack.append((lb, ub, parent_bound))
            stop[0] = limits.WALL_CLOCK
            raise limits.SolveInterrupted(summary()) from None
        nodes += 1
        if lp.status == INFEASIBLE:
            continue
        if lp.x is None:
            leaf_bounds.append(parent_bound)
            if lp.status == TIME_LIMIT:
                stop[0] = limits.WALL_CLOCK
            continue
        if prune_at(lp.objective):
            leaf_bounds.append(lp.objective)
            continue
        frac = next((j for j in order if abs(lp.x[j] - round(lp.x[j])) > 1e-6), None)
        if frac is not None and nodes < max_nodes:
            v = lp.x[frac]
            down = (lb, {**ub, frac: float(math.floor(v))}, lp.objective)
            up = ({**lb, frac: float(math.ceil(v))}, ub, lp.objective)
            # explore the nearer side first (pushed last)
            if v - math.floor(v) < 0.5:
                stack += [up, down]
            else:
                stack += [down, up]
            continue
        ws = best_x if best_x is not None and sub.max_violation(best_x) <= 1e-6 else None
        opts = dict(hopts)
        if best < INF:
            opts["objective_bound"] = best + max(gap_abs, 1e-9 * abs(best))
        try:
            with limits.within(best, min([best] + leaf_bounds + [b for _, _, b in stack])):
                res = solve_highs(sub, dataclasses.replace(run, time_limit_s=left(), warm_start=ws,
                                                           node_limit=nodes_left()), opts)
        except limits.SolveInterrupted as e:
            leaf = e.result
            if leaf is not None and leaf.x is not None and leaf.objective < best:
                best, best_x = leaf.objective, leaf.x
            leaf_bounds.append(lp.objective if leaf is None or not math.isfinite(leaf.bound) else max(lp.objective, min(leaf.bound, best)))
            stop[0] = limits.WALL_CLOCK
            raise limits.SolveInterrupted(summary()) from None
        nodes += res.nodes
        if res.status == INFEASIBLE:
            # nothing better than the cutoff (or truly infeasible) in this leaf
            leaf_bounds.append(best if best < INF else INF)
            continue
        if res.x is not None and res.objective < best:
            best, best_x = res.objective, res.x
        leaf_bounds.append(max(lp.objective, res.bound) if res.x is not None or res.status == OPTIMAL else lp.objective)
        if res.stopped_by and stop[0] != limits.WALL_CLOCK:
            stop[0] = res.stopped_by
        if best_x is not None:
            limits.report(best, min([best] + leaf_bounds + [b for _, _, b in stack]),
                          relative_gap(best, min([best] + leaf_bounds + [b for _, _, b in stack])))
    return summary()
