"""The HiGHS back-end: HiGHS through ``highspy`` directly (the matrix is passed in one call).

HiGHS has no branching priorities: :func:`~sacplan.solver.count_branching.branch_on_priorities` branches on the
priority columns itself and solves each leaf here (CBC reads priorities natively, see :mod:`sacplan.solver.cbc`).
Deterministic: one thread unless asked otherwise, fixed random seed, a node limit (``mip_max_nodes``) as the work
limit; the time limit is only the safety net.
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
from sacplan.solver import limits, progress
from sacplan.solver.model import (
    ERROR,
    INF,
    INFEASIBLE,
    OPTIMAL,
    TIME_LIMIT,
    MilpModel,
    RunSettings,
    SolveInterrupted,
    SolveResult,
    relative_gap,
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

    h = _configured(run, highs_options)
    # kWarning is returned for valid models with tiny coefficients (HiGHS drops them); only kError is fatal.
    if h.passModel(_highs_lp(model)) == highspy.HighsStatus.kError:
        raise SolverError("HiGHS rejected the model (passModel failed)")
    if run.warm_start is not None:
        sol = highspy.HighsSolution()
        sol.col_value = [float(v) for v in run.warm_start]
        sol.value_valid = True
        h.setSolution(sol)
    t0 = time.perf_counter()
    interrupted = _run(h)
    solve_s = time.perf_counter() - t0
    ms = h.getModelStatus()
    info = h.getInfo()
    has_x = info.primal_solution_status == 2  # kSolutionStatusFeasible
    x = list(h.getSolution().col_value) if has_x else None
    objective = model.evaluate(x) if x is not None else INF
    if (
        not interrupted
        and any(model.col_int)
        and ms == highspy.HighsModelStatus.kOptimal
        and run.warm_start is not None
        and x is not None
        and objective - float(info.objective_function_value) > max(run.gap_abs, 1e-9 * max(1.0, abs(objective)))
    ):
        # HiGHS 1.16 can report a better MIP objective than the solution vector it returns, which is then the
        # warm start handed in (seen when presolve settles the model): the better vector is lost, so solve again
        # without the warm start.
        res = solve_highs(model, dataclasses.replace(run, warm_start=None), highs_options)
        return dataclasses.replace(res, solve_s=res.solve_s + solve_s, log="HiGHS re-run without the warm start: its "
                                   "solution vector was the warm start, not the better objective it reported")
    res = _result(model, ms, info, h.modelStatusToString(ms), x, objective, solve_s)
    if interrupted:
        raise SolveInterrupted(res)
    return res


def _run(h: Any) -> bool:
    """Run a prepared ``highspy.Highs`` in its solver thread, reporting progress; True when Ctrl-C stopped it
    (the caller reads the best solution and raises :class:`~sacplan.solver.model.SolveInterrupted`)."""
    stop = [False]
    seen = [math.inf, -math.inf, math.inf]

    def on_interrupt(e: Any) -> None:
        d = e.data_out
        try:
            seen[0], seen[1], seen[2] = d.mip_primal_bound, d.mip_dual_bound, d.mip_gap
        except AttributeError:  # pragma: no cover - older highspy
            pass
        if stop[0]:
            e.interrupt()

    for event in (h.cbMipInterrupt, h.cbSimplexInterrupt, h.cbIpmInterrupt):
        event.subscribe(on_interrupt)
    interrupted = False
    thread = h.startSolve()
    while True:
        try:
            done, _ = h.wait(0.2)
            if done:
                break
            inc, bnd = seen[0], seen[1]
            if math.isfinite(inc) and abs(inc) < 1e29:
                progress.report(inc, bnd if abs(bnd) < 1e29 else -math.inf, seen[2] if abs(seen[2]) < 1e29 else math.inf)
        except KeyboardInterrupt:
            interrupted = True
            stop[0] = True
    thread.join()
    return interrupted


def _configured(run: RunSettings, highs_options: Mapping[str, Any] | None) -> Any:
    """A fresh ``highspy.Highs`` with ``run``'s settings: one thread and a fixed seed unless asked otherwise
    (deterministic), the gaps, tolerances, node limit (deterministic) and time limit (the safety net)."""
    time_limit_s, gap_rel, gap_abs, threads, _, feas_tol = run.fields()
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
    return h


def _highs_lp(model: MilpModel) -> Any:
    """``model`` as a ``highspy.HighsLp`` (rowwise matrix, integrality when any column is integer)."""
    import highspy

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
    return lp


def _result(model: MilpModel, ms: Any, info: Any, raw: str, x: list[float] | None, objective: float,
            solve_s: float) -> SolveResult:
    """The normalised :class:`SolveResult` of a finished HiGHS run (model status ``ms``, ``info``)."""
    import highspy

    status_of = highspy.HighsModelStatus
    mip = any(model.col_int)
    if ms == status_of.kOptimal:
        status = OPTIMAL
        bound = float(info.mip_dual_bound) if mip else objective
        bound = min(bound, objective)
    elif ms == status_of.kInfeasible:
        status, x, objective, bound = INFEASIBLE, None, INF, INF
    elif ms in (status_of.kTimeLimit, status_of.kInterrupt, status_of.kSolutionLimit, status_of.kIterationLimit):
        status = TIME_LIMIT
        bound = float(info.mip_dual_bound) if mip else -INF
        if x is not None:
            bound = min(bound, objective)
    else:
        status, bound = (TIME_LIMIT if x is not None else ERROR), (float(info.mip_dual_bound) if mip else -INF)
    gap = relative_gap(objective, bound) if x is not None else INF
    stopped_by = ""
    if ms in (status_of.kSolutionLimit, status_of.kIterationLimit):
        stopped_by = limits.WORK_LIMIT  # mip_max_nodes: counted, the same on every run
    elif ms == status_of.kTimeLimit:
        stopped_by = limits.WALL_CLOCK
    nodes = int(info.mip_node_count) if mip and int(info.mip_node_count) > 0 else 0
    return SolveResult(status, x, objective, bound, gap, solve_s, "highs", raw, nodes=nodes, stopped_by=stopped_by)
