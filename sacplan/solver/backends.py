"""MILP back-ends: :func:`solve_model` runs a :class:`~sacplan.solver.model.MilpModel` on

* ``"cbc"``: PuLP's bundled CBC through ``COIN_CMD`` (:func:`solve_cbc`): branching priorities handed over natively,
  CBC's log read for the best bound and gap PuLP does not report;
* ``"highs"``: ``highspy``, the matrix passed in one call (:func:`solve_highs`); it has no branching priorities:
  :func:`~sacplan.solver.count_branching.branch_on_priorities` branches on those columns itself.

Both return a normalised :class:`~sacplan.solver.model.SolveResult`. Runs are deterministic: one thread unless
asked otherwise, fixed seeds, a node limit as the work limit (the time limit is only the safety net).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Any, Mapping, Sequence

import numpy as np

from sacplan.errors import SolverError
from sacplan.solver import count_branching, limits, progress
from sacplan.solver.model import (
    ERROR, INF, INFEASIBLE, OPTIMAL, TIME_LIMIT, MilpModel, RunSettings, SolveInterrupted, SolveResult, relative_gap,
)

#: Solver names :func:`solve_model` accepts.
SOLVERS = ("cbc", "highs")


def check_solver(name: str) -> str:
    """Normalise a solver name; :class:`SolverError` saying how to install it when unusable."""
    key = str(name).lower().strip()
    if key == "auto":
        # HiGHS when installed (the [highs] / [test] extras): it proves the symmetric many-block MILPs that CBC
        # cannot close in minutes (Llama-70B, 80 blocks, 401 units: HiGHS 9 s; CBC still at a 1.3e-4 gap after
        # 120 s even when handed the optimum); else CBC, which PuLP bundles.
        key = "highs" if _has_highs() else "cbc"
    if key in ("cbc", "pulp", "pulp_cbc", "coin"):
        try:
            import pulp  # noqa: F401
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise SolverError("solver 'cbc' needs PuLP (which bundles CBC): pip install pulp") from e
        if cbc_path() is None:  # pragma: no cover
            raise SolverError(
                "solver 'cbc': PuLP's bundled CBC binary is missing for this platform; install CBC "
                "(apt-get install coinor-cbc, or pip install 'pulp[cbc]') or use solver='highs'"
            )
        return "cbc"
    if key in ("highs", "highspy"):
        if not _has_highs():
            raise SolverError("solver 'highs' needs highspy: pip install highspy")
        return "highs"
    raise SolverError(
        f"unknown solver {name!r}: use 'auto' (HiGHS if installed, else CBC), 'cbc' (pip install pulp, which "
        "bundles CBC) or 'highs' (pip install highspy)"
    )


def solve_model(
    model: MilpModel,
    solver: str = "cbc",
    *,
    time_limit_s: float | None = None,
    gap_rel: float = 1e-4,
    gap_abs: float = 1e-9,
    threads: int | None = None,
    warm_start: Sequence[float] | None = None,
    priorities: Mapping[int, int] | None = None,
    options: Sequence[str] = (),
    node_limit: int | None = None,
    shared: bool = True,
) -> SolveResult:
    """Solve ``model`` with ``solver`` (``"cbc"`` or ``"highs"``) under the settings of
    :class:`~sacplan.solver.model.RunSettings`, the time limit capped by the call's :func:`limits.deadline` and,
    when ``shared``, the node limit by its :func:`limits.work` budget, which the run is charged (False: the small
    op-level knapsacks, which carry their own). ``priorities``: ``{integer column: priority}``, smaller branched
    first (CBC natively; HiGHS by :func:`~sacplan.solver.count_branching.branch_on_priorities`). ``options``: raw
    CBC options, e.g. ``["preprocess off"]``. Cut short, the best solution found comes with status
    ``"time_limit"`` (``x`` None when none) and the stop is recorded (:func:`limits.stopped`); Ctrl-C raises
    :class:`~sacplan.solver.model.SolveInterrupted` with the best result so far."""
    name = check_solver(solver)
    if model.num_cols == 0:
        return SolveResult(OPTIMAL, [], model.obj_offset, model.obj_offset, 0.0, 0.0, name, "empty")
    time_limit_s = limits.remaining(time_limit_s)  # never past the enclosing call's budget (limits.deadline)
    if shared:
        node_limit = limits.nodes_left(node_limit)
    run = RunSettings(time_limit_s, gap_rel, gap_abs, threads, warm_start, node_limit=node_limit)
    res = _run(model, name, run, priorities, options)
    if shared:
        limits.spend(res.nodes)
    if res.stopped_by:
        limits.stopped(res.stopped_by, model.name)
    return res


def _run(
    model: MilpModel, name: str, run: RunSettings, priorities: Mapping[int, int] | None, options: Sequence[str]
) -> SolveResult:
    """One back-end run (CBC with its fallbacks, or HiGHS with count branching)."""
    if name == "cbc":
        try:
            return solve_cbc(model, run, priorities, options)
        except SolverError as first:
            # The bundled CBC binary occasionally dies without a log on a valid model (seen with
            # warm starts). Retry plainly, then with HiGHS when installed; say so in the result.
            try:
                res = solve_cbc(model, dataclasses.replace(run, warm_start=None), None, options)
                return dataclasses.replace(res, log=f"CBC retried without warm start/priorities after: {first}\n" + res.log)
            except SolverError:
                if not _has_highs():
                    raise first from None
                res = solve_highs(model, run)
                return dataclasses.replace(res, log=f"CBC failed ({first}); solved with HiGHS\n" + res.log)
    if priorities and any(model.col_int):
        return count_branching.branch_on_priorities(model, priorities, run)
    return solve_highs(model, run)


def lp_solver(solver: str) -> str:
    """The back-end of auxiliary problems (the heuristic's LPs, op-level knapsacks): in-process HiGHS when
    installed (a CBC call costs a subprocess and an MPS file), else ``solver``."""
    return "highs" if _has_highs() else solver


def _has_highs() -> bool:
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


# -- CBC -----------------------------------------------------------------------------------------------------------
def cbc_path() -> str | None:
    """PuLP's bundled CBC binary when it is there and executable, else ``cbc`` on ``PATH`` (None: neither)."""
    import pulp

    path = getattr(pulp.PULP_CBC_CMD, "pulp_cbc_path", None)
    if path and os.path.exists(path) and os.access(path, os.X_OK):
        return path
    return shutil.which("cbc")


_FLOAT = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|inf|-inf|nan)"
#: what :func:`_parse_cbc_log` reads: key -> (pattern, conversion, whether the last match counts rather than the first)
_CBC_LOG = {
    "result": (r"^Result - (.*)$", str.strip, False),
    "bound": (r"^Lower bound:\s+" + _FLOAT, float, False),
    # search summary lines give the bound when CBC stops inside its gap tolerance
    "best_possible": (r"best possible " + _FLOAT, float, True),
    "exit_gap_abs": (r"Exiting as integer gap of " + _FLOAT, float, True),
    "nodes": (r"^Enumerated nodes:\s+(\d+)", int, False),
}


def _parse_cbc_log(text: str) -> dict[str, Any]:
    """Result line, best bound, nodes and how the search ended, from a CBC log (PuLP does not return them)."""
    out: dict[str, Any] = {}
    for key, (pattern, conv, last) in _CBC_LOG.items():
        found = re.findall(pattern, text, re.M)
        if found:
            out[key] = conv(found[-1 if last else 0])
    out["search_completed"] = "Search completed - best objective" in text
    return out


def solve_cbc(
    model: MilpModel, run: RunSettings, priorities: Mapping[int, int] | None = None, extra_options: Sequence[str] = ()
) -> SolveResult:
    """Solve ``model`` with PuLP's CBC under ``run`` (``priorities``, ``extra_options``: as :func:`solve_model`)."""
    import pulp

    prob, cols = _pulp_problem(model)
    if run.warm_start is not None:
        for v, x0 in zip(cols, run.warm_start):
            v.setInitialValue(float(x0), check=False)
    options = [
        "randomCbcSeed 1",
        "randomSeed 1",
        f"primalTolerance {run.feas_tol:g}",
        f"integerTolerance {max(run.feas_tol, 1e-9):g}",
    ]
    if run.node_limit is not None:
        options.append(f"maxNodes {max(1, int(run.node_limit))}")  # counted: the same stop on every run
    options += list(extra_options)
    with tempfile.TemporaryDirectory(prefix="sacplan_cbc_") as tmp:
        log_path = os.path.join(tmp, "cbc.log")
        if priorities:
            # PuLP renames columns X0000000.. in the order of prob.variables() (sorted by name) when it
            # writes the MPS file; map our columns to those names.
            mps_name = {v.name: "X%07d" % i for i, v in enumerate(prob.variables())}
            prio_path = os.path.join(tmp, "priorities.csv")
            with open(prio_path, "w") as f:
                f.write("name,priority\n")
                for j, pr in sorted(priorities.items()):
                    if cols[j].name in mps_name:
                        f.write(f"{mps_name[cols[j].name]},{int(pr)}\n")
            options.append(f"priorityIn {prio_path}")
        cmd = pulp.COIN_CMD(
            path=cbc_path(),
            msg=False,
            timeLimit=None if run.time_limit_s is None else max(0.01, float(run.time_limit_s)),
            gapRel=run.gap_rel,
            gapAbs=run.gap_abs,
            threads=run.threads,  # None: CBC's serial default (deterministic)
            warmStart=run.warm_start is not None,
            logPath=log_path,
            options=options,
        )
        cmd.tmpDir = tmp
        t0 = time.perf_counter()
        try:
            prob.solve(cmd)
        except KeyboardInterrupt:
            # CBC runs as a child process under its own time limit; its result is lost with the temp dir
            raise SolveInterrupted(None) from None
        except pulp.PulpSolverError as e:
            raise SolverError(f"CBC failed: {e}; CBC log tail: {_read(log_path)[-600:]!r}") from e
        solve_s = time.perf_counter() - t0
        log = _read(log_path)
    return _cbc_result(model, prob, cols, log, solve_s)


def _read(path: str) -> str:
    """The text of the file at ``path`` ("" when it cannot be read: CBC died before writing its log)."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _pulp_problem(model: MilpModel) -> tuple[Any, list[Any]]:
    """``model`` as a PuLP problem and its columns, in order (one affine expression per row, PuLP's fast path)."""
    import pulp

    prob = pulp.LpProblem(model.name, pulp.LpMinimize)
    make_var = getattr(prob, "add_variable", None) or pulp.LpVariable  # PuLP >= 3.3: no deprecation warning
    cols = [
        make_var(
            f"c{j:07d}",
            None if lb == -INF else lb,
            None if ub == INF else ub,
            pulp.LpInteger if integer else pulp.LpContinuous,
        )
        for j, (lb, ub, integer) in enumerate(zip(model.col_lb, model.col_ub, model.col_int))
    ]
    prob.setObjective(
        pulp.LpAffineExpression([(cols[j], c) for j, c in enumerate(model.col_cost) if c != 0.0], constant=0.0)
    )
    for i in range(model.num_rows):
        idx, val = model.row(i)
        lb, ub = model.row_lb[i], model.row_ub[i]
        expr = [(cols[j], v) for j, v in zip(idx, val)]
        if not expr:
            continue
        name = f"r{i:07d}"
        if lb == ub:
            prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(expr), pulp.LpConstraintEQ, name, lb))
            continue
        if lb != -INF:
            prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(expr), pulp.LpConstraintGE, name + "l", lb))
        if ub != INF:
            prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(expr), pulp.LpConstraintLE, name + "u", ub))
    return prob, cols


def _cbc_result(model: MilpModel, prob: Any, cols: list[Any], log: str, solve_s: float) -> SolveResult:
    """The normalised :class:`SolveResult` of a finished CBC run, from PuLP's status and CBC's ``log``."""
    import pulp

    info = _parse_cbc_log(log)
    result = info.get("result", "")
    low = result.lower()
    x = None
    if prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        # CBC presolve may leave columns that appear in no row without a value: 0 within their bounds
        x = [float(v.varValue) if v.varValue is not None else min(max(0.0, lb), ub)
             for v, lb, ub in zip(cols, model.col_lb, model.col_ub)]
    objective = model.evaluate(x) if x is not None else INF
    if result.startswith("Optimal") or (prob.status == pulp.LpStatusOptimal and prob.sol_status == pulp.LpSolutionOptimal):
        status = OPTIMAL
        if "bound" in info:
            bound = info["bound"]
        elif "exit_gap_abs" in info:
            bound = objective - info["exit_gap_abs"]
        elif info.get("search_completed") or "best_possible" not in info:
            bound = objective
        else:
            bound = min(objective, info["best_possible"])
        bound = min(bound, objective)
    elif "infeasible" in low or prob.status == pulp.LpStatusInfeasible:
        status, bound, objective = INFEASIBLE, INF, INF
        x = None
    elif "time" in low or "node" in low:  # "Stopped on time", "Stopped on nodes"
        status = TIME_LIMIT
        bound = info.get("bound", info.get("best_possible", -INF))
        if x is not None:
            bound = min(bound, objective)
    elif x is not None:
        status, bound = TIME_LIMIT, info.get("bound", -INF)
    else:
        status, bound = ERROR, -INF
    gap = relative_gap(objective, bound) if x is not None else INF
    stopped_by = limits.WORK_LIMIT if "node" in low else limits.WALL_CLOCK if "time" in low else ""
    return SolveResult(status, x, objective, bound, gap, solve_s, "cbc", result or pulp.LpStatus[prob.status], log,
                       nodes=int(info.get("nodes", 0)), stopped_by=stopped_by)


# -- HiGHS ---------------------------------------------------------------------------------------------------------
#: True once this process has built a ``highspy.Highs`` (its banner is printed only then)
_HIGHS_STARTED = False


def _new_highs() -> Any:
    """A ``highspy.Highs``, the first of a process built with file descriptor 1 on /dev/null: HiGHS prints its
    banner from C++ then, before ``output_flag`` can be set (into the CLI's plan, or a user's output)."""
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
    """Solve ``model`` with in-process HiGHS under ``run`` (``highs_options``: extra HiGHS options, by name)."""
    import highspy

    h = _highs_configured(run, highs_options)
    # kWarning is returned for valid models with tiny coefficients (HiGHS drops them); only kError is fatal.
    if h.passModel(_highs_lp(model)) == highspy.HighsStatus.kError:
        raise SolverError("HiGHS rejected the model (passModel failed)")
    if run.warm_start is not None:
        sol = highspy.HighsSolution()
        sol.col_value = [float(v) for v in run.warm_start]
        sol.value_valid = True
        h.setSolution(sol)
    t0 = time.perf_counter()
    interrupted = _highs_wait(h)
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
    res = _highs_result(model, ms, info, h.modelStatusToString(ms), x, objective, solve_s)
    if interrupted:
        raise SolveInterrupted(res)
    return res


def _highs_wait(h: Any) -> bool:
    """Run a prepared ``highspy.Highs`` in its thread, reporting progress; True when Ctrl-C stopped it."""
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


def _highs_configured(run: RunSettings, highs_options: Mapping[str, Any] | None) -> Any:
    """A fresh ``highspy.Highs`` with ``run``'s settings (one thread and a fixed seed unless asked otherwise)."""
    h = _new_highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("random_seed", 1)
    h.setOptionValue("threads", int(run.threads) if run.threads else 1)
    h.setOptionValue("mip_rel_gap", float(run.gap_rel))
    h.setOptionValue("mip_abs_gap", float(run.gap_abs))
    h.setOptionValue("primal_feasibility_tolerance", max(run.feas_tol, 1e-10))
    h.setOptionValue("mip_feasibility_tolerance", max(run.feas_tol, 1e-10))
    if run.time_limit_s is not None:
        h.setOptionValue("time_limit", max(0.01, float(run.time_limit_s)))
    if run.node_limit is not None:
        h.setOptionValue("mip_max_nodes", max(1, int(run.node_limit)))
    for k, v in (highs_options or {}).items():
        h.setOptionValue(k, v)
    return h


def _highs_lp(model: MilpModel) -> Any:
    """``model`` as a ``highspy.HighsLp`` (rowwise matrix; ``highspy.kHighsInf`` is ``math.inf``)."""
    import highspy

    lp = highspy.HighsLp()
    lp.num_col_ = model.num_cols
    lp.num_row_ = model.num_rows
    lp.col_cost_ = np.asarray(model.col_cost, dtype=float)
    lp.col_lower_ = np.asarray(model.col_lb, dtype=float)
    lp.col_upper_ = np.asarray(model.col_ub, dtype=float)
    lp.row_lower_ = np.asarray(model.row_lb, dtype=float)
    lp.row_upper_ = np.asarray(model.row_ub, dtype=float)
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


def _highs_result(model: MilpModel, ms: Any, info: Any, raw: str, x: list[float] | None, objective: float,
            solve_s: float) -> SolveResult:
    """The normalised :class:`SolveResult` of a finished HiGHS run (model status ``ms``)."""
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
