"""The CBC back-end: COIN-OR CBC, the binary bundled with PuLP, driven through PuLP's ``COIN_CMD``.

The model is built with PuLP's fast paths (one :class:`pulp.LpAffineExpression` per row from a list of pairs);
branching priorities are handed to CBC natively (``priorityIn``). CBC's log is captured to read the best bound
and gap, which PuLP does not report. Deterministic: serial unless asked otherwise, fixed random seeds.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from typing import Any, Mapping, Sequence

from sacplan.errors import SolverError
from sacplan.solver import limits
from sacplan.solver.model import (
    ERROR, INF, INFEASIBLE, OPTIMAL, TIME_LIMIT, MilpModel, RunSettings, SolveInterrupted, SolveResult, relative_gap,
)


def cbc_path() -> str | None:
    """PuLP's bundled CBC binary when it is there and executable, else ``cbc`` on ``PATH`` (None: neither)."""
    import pulp

    path = getattr(pulp.PULP_CBC_CMD, "pulp_cbc_path", None)
    if path and os.path.exists(path) and os.access(path, os.X_OK):
        return path
    import shutil

    return shutil.which("cbc")


_FLOAT = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|inf|-inf|nan)"


def _parse_cbc_log(text: str) -> dict[str, Any]:
    """Result line, objective, best bound and gap from a CBC log (PuLP does not return them)."""
    out: dict[str, Any] = {}
    m = re.search(r"^Result - (.*)$", text, re.M)
    if m:
        out["result"] = m.group(1).strip()
    m = re.search(r"^Objective value:\s+" + _FLOAT, text, re.M)
    if m:
        out["objective"] = float(m.group(1))
    m = re.search(r"^Lower bound:\s+" + _FLOAT, text, re.M)
    if m:
        out["bound"] = float(m.group(1))
    m = re.search(r"^Gap:\s+" + _FLOAT, text, re.M)
    if m:
        out["gap"] = float(m.group(1))
    # Search summary lines give the bound when CBC stops inside its gap tolerance.
    bp = re.findall(r"best possible " + _FLOAT, text)
    if bp:
        out["best_possible"] = float(bp[-1])
    m = re.findall(r"Exiting as integer gap of " + _FLOAT, text)
    if m:
        out["exit_gap_abs"] = float(m[-1])
    if re.search(r"Search completed - best objective", text):
        out["search_completed"] = True
    m = re.search(r"^Enumerated nodes:\s+(\d+)", text, re.M)
    if m:
        out["nodes"] = int(m.group(1))
    return out


def solve_cbc(
    model: MilpModel, run: RunSettings, priorities: Mapping[int, int] | None = None, extra_options: Sequence[str] = ()
) -> SolveResult:
    """Solve ``model`` with PuLP's CBC under ``run`` (``priorities``: branching priorities per integer column;
    ``extra_options``: raw CBC command-line options)."""
    import pulp

    time_limit_s, gap_rel, gap_abs, threads, warm_start, feas_tol = run.fields()
    prob, cols = _pulp_problem(model)
    if warm_start is not None:
        for v, x0 in zip(cols, warm_start):
            v.setInitialValue(float(x0), check=False)
    options = [
        "randomCbcSeed 1",
        "randomSeed 1",
        f"primalTolerance {feas_tol:g}",
        f"integerTolerance {max(feas_tol, 1e-9):g}",
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
            timeLimit=None if time_limit_s is None else max(0.01, float(time_limit_s)),
            gapRel=gap_rel,
            gapAbs=gap_abs,
            threads=threads,  # None: CBC's serial default (deterministic)
            warmStart=warm_start is not None,
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
            try:
                with open(log_path) as f:
                    tail = f.read()[-600:]
            except OSError:
                tail = ""
            raise SolverError(f"CBC failed: {e}; CBC log tail: {tail!r}") from e
        solve_s = time.perf_counter() - t0
        try:
            with open(log_path) as f:
                log = f.read()
        except OSError:
            log = ""
    return _result(model, prob, cols, log, solve_s)


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


def _result(model: MilpModel, prob: Any, cols: list[Any], log: str, solve_s: float) -> SolveResult:
    """The normalised :class:`SolveResult` of a finished CBC run, from PuLP's status and CBC's ``log``."""
    import pulp

    info = _parse_cbc_log(log)
    result = info.get("result", "")
    has_x = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    x = [float(v.varValue) if v.varValue is not None else 0.0 for v in cols] if has_x else None
    if x is not None:
        # CBC presolve may leave columns that appear in no row at an arbitrary bound value.
        for j, v in enumerate(cols):
            if v.varValue is None:
                x[j] = min(max(0.0, model.col_lb[j]), model.col_ub[j])
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
    elif "infeasible" in result.lower() or prob.status == pulp.LpStatusInfeasible:
        status, bound, objective = INFEASIBLE, INF, INF
        x = None
    elif result.startswith("Stopped on time") or "time" in result.lower() or "node" in result.lower():
        status = TIME_LIMIT
        bound = info.get("bound", info.get("best_possible", -INF))
        if x is not None:
            bound = min(bound, objective)
    elif x is not None:
        status, bound = TIME_LIMIT, info.get("bound", -INF)
    else:
        status, bound = ERROR, -INF
    if x is None and status == TIME_LIMIT:
        objective = INF
    gap = relative_gap(objective, bound) if x is not None else INF
    low = result.lower()
    stopped_by = limits.WORK_LIMIT if "node" in low else limits.WALL_CLOCK if "time" in low else ""
    return SolveResult(status, x, objective, bound, gap, solve_s, "cbc", result or pulp.LpStatus[prob.status], log,
                       nodes=int(info.get("nodes", 0)), stopped_by=stopped_by)
