"""MILP back-ends: a solver-neutral sparse model and two ways to solve it.

The formulations in :mod:`sacplan.solve.milp`, :mod:`sacplan.solve.ops` and :mod:`sacplan.solve.compat`
build a :class:`MilpModel` (columns with bounds/integrality/cost, rows in CSR form with lower/upper
bounds, always *minimise*). :func:`solve_model` hands it to

* ``"cbc"``: COIN-OR CBC, the binary bundled with PuLP, driven through PuLP's ``COIN_CMD`` (the model is
  built with PuLP's fast paths: one :class:`pulp.LpAffineExpression` per row from a list of pairs). CBC's
  log is captured to read the best bound and gap, which PuLP does not report.
* ``"highs"``: HiGHS through ``highspy`` directly (the matrix is passed in one call).

Both return a :class:`SolveResult` with a normalised status, objective, best bound, relative gap and wall
seconds. Runs are deterministic: one thread unless asked otherwise, fixed random seeds.
"""

from __future__ import annotations

import dataclasses

import math
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from sacplan.errors import SolverError
from sacplan.solve import limits

#: Solver names :func:`solve_model` accepts.
SOLVERS = ("cbc", "highs")

#: Normalised statuses.
OPTIMAL = "optimal"
TIME_LIMIT = "time_limit"
INTERRUPTED = "interrupted"
INFEASIBLE = "infeasible"
ERROR = "error"

INF = math.inf


@dataclass
class MilpModel:
    """A minimisation MILP in solver-neutral form.

    Columns have ``lb <= x <= ub`` (``±inf`` allowed), an ``integer`` flag and an objective ``cost``;
    rows are ``row_lb <= sum(values[k] * x[index[k]] for k in start[i]:start[i+1]) <= row_ub``.
    """

    name: str = "sacplan"
    col_names: list[str] = field(default_factory=list)
    col_lb: list[float] = field(default_factory=list)
    col_ub: list[float] = field(default_factory=list)
    col_int: list[bool] = field(default_factory=list)
    col_cost: list[float] = field(default_factory=list)
    row_names: list[str] = field(default_factory=list)
    row_lb: list[float] = field(default_factory=list)
    row_ub: list[float] = field(default_factory=list)
    row_start: list[int] = field(default_factory=lambda: [0])
    row_index: list[int] = field(default_factory=list)
    row_value: list[float] = field(default_factory=list)
    obj_offset: float = 0.0

    # -- building -------------------------------------------------------------------------------------
    def add_col(self, name: str, lb: float = 0.0, ub: float = INF, integer: bool = False, cost: float = 0.0) -> int:
        self.col_names.append(name)
        self.col_lb.append(float(lb))
        self.col_ub.append(float(ub))
        self.col_int.append(bool(integer))
        self.col_cost.append(float(cost))
        return len(self.col_names) - 1

    def add_row(
        self, name: str, index: Sequence[int], value: Sequence[float], lb: float = -INF, ub: float = INF
    ) -> int:
        """Add one row; repeated column indices are summed, zero coefficients dropped."""
        if len(set(index)) != len(index):
            acc: dict[int, float] = {}
            for j, v in zip(index, value):
                acc[j] = acc.get(j, 0.0) + float(v)
            index, value = list(acc), list(acc.values())
        for j, v in zip(index, value):
            if v != 0.0:
                self.row_index.append(int(j))
                self.row_value.append(float(v))
        self.row_start.append(len(self.row_index))
        self.row_names.append(name)
        self.row_lb.append(float(lb))
        self.row_ub.append(float(ub))
        return len(self.row_names) - 1

    @property
    def num_cols(self) -> int:
        return len(self.col_names)

    @property
    def num_rows(self) -> int:
        return len(self.row_names)

    @property
    def num_nonzeros(self) -> int:
        return len(self.row_index)

    @property
    def num_integer(self) -> int:
        return sum(self.col_int)

    def row(self, i: int) -> tuple[list[int], list[float]]:
        a, b = self.row_start[i], self.row_start[i + 1]
        return self.row_index[a:b], self.row_value[a:b]

    def evaluate(self, x: Sequence[float]) -> float:
        return self.obj_offset + float(np.dot(np.asarray(self.col_cost), np.asarray(x, dtype=float)))

    def max_violation(self, x: Sequence[float]) -> float:
        """Largest bound or row violation of ``x`` (model units), for checks and tests."""
        xv = np.asarray(x, dtype=float)
        viol = 0.0
        if len(xv):
            viol = max(viol, float(np.max(np.asarray(self.col_lb) - xv)), float(np.max(xv - np.asarray(self.col_ub))))
        for i in range(self.num_rows):
            idx, val = self.row(i)
            act = float(np.dot(val, xv[idx])) if idx else 0.0
            viol = max(viol, self.row_lb[i] - act, act - self.row_ub[i])
        return viol

    def stats(self) -> dict[str, int]:
        return {
            "columns": self.num_cols,
            "integer_columns": self.num_integer,
            "rows": self.num_rows,
            "nonzeros": self.num_nonzeros,
        }


@dataclass
class SolveResult:
    """What a back-end returns (objective/bound in model units, i.e. including ``obj_offset``)."""

    status: str  # OPTIMAL | TIME_LIMIT | INFEASIBLE | ERROR
    x: list[float] | None
    objective: float
    bound: float
    gap: float
    solve_s: float
    solver: str
    raw_status: str = ""
    log: str = ""


def relative_gap(objective: float, bound: float) -> float:
    """``|objective - bound| / max(|objective|, 1e-10)``, 0 when both are 0 (the convention of CBC/HiGHS)."""
    if not (math.isfinite(objective) and math.isfinite(bound)):
        return INF
    diff = max(0.0, objective - bound)
    if diff <= 1e-12:
        return 0.0
    return diff / max(abs(objective), 1e-10)


def check_solver(name: str) -> str:
    """Normalise a solver name; :class:`SolverError` saying how to install it when unusable."""
    key = str(name).lower().strip()
    if key == "auto":
        # HiGHS when installed (the [highs] / [test] extras): it proves the symmetric many-block MILPs that CBC
        # cannot close in minutes (Llama-70B, 80 blocks, 401 units: HiGHS 9 s; CBC still at a 1.3e-4 gap after
        # 120 s even when handed the optimum); else CBC, which PuLP bundles.
        try:
            import highspy  # noqa: F401

            return "highs"
        except ImportError:
            key = "cbc"
    if key in ("cbc", "pulp", "pulp_cbc", "coin"):
        try:
            import pulp  # noqa: F401
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise SolverError("solver 'cbc' needs PuLP (which bundles CBC): pip install pulp") from e
        if _cbc_path() is None:  # pragma: no cover
            raise SolverError(
                "solver 'cbc': PuLP's bundled CBC binary is missing for this platform; install CBC "
                "(apt-get install coinor-cbc, or pip install 'pulp[cbc]') or use solver='highs'"
            )
        return "cbc"
    if key in ("highs", "highspy"):
        try:
            import highspy  # noqa: F401
        except ImportError as e:
            raise SolverError("solver 'highs' needs highspy: pip install highspy") from e
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
    feas_tol: float = 1e-9,
    priorities: Mapping[int, int] | None = None,
    options: Sequence[str] = (),
    highs_options: Mapping[str, Any] | None = None,
) -> SolveResult:
    """Solve ``model`` with ``solver`` ("cbc" or "highs"); see :class:`SolveResult`.

    Args:
        time_limit_s: wall-clock limit (None = none), capped by the active :func:`limits.deadline`; on expiry
            the best solution found is returned with status ``"time_limit"`` (``x`` None when none was found).
            Ctrl-C raises :class:`limits.SolveInterrupted` carrying the best result so far.
        gap_rel, gap_abs: stop once the relative / absolute gap is this small.
        threads: solver threads (None: serial CBC / one HiGHS thread, which keeps the search deterministic).
        warm_start: a full column vector to start from (a feasible incumbent helps a lot).
        feas_tol: primal feasibility tolerance (model units).
        priorities: branching priorities for integer columns, ``{column: priority}`` (smaller = branched
            first). CBC reads them natively; for HiGHS, which has none, they are branched on here first
            (see :func:`_branch_on_priorities`).
        options: extra raw CBC command-line options (CBC only), e.g. ``["preprocess off"]``.
        highs_options: extra HiGHS options (HiGHS only), e.g. ``{"mip_heuristic_effort": 0.0}``.
    """
    name = check_solver(solver)
    if model.num_cols == 0:
        return SolveResult(OPTIMAL, [], model.obj_offset, model.obj_offset, 0.0, 0.0, name, "empty")
    time_limit_s = limits.remaining(time_limit_s)  # never past the enclosing call's budget (limits.deadline)
    if name == "cbc":
        try:
            return _solve_cbc(model, time_limit_s, gap_rel, gap_abs, threads, warm_start, feas_tol, priorities, options)
        except SolverError as first:
            # The bundled CBC binary occasionally dies without a log on a valid model (seen with
            # warm starts). Retry plainly, then with HiGHS when installed; say so in the result.
            try:
                res = _solve_cbc(model, time_limit_s, gap_rel, gap_abs, threads, None, feas_tol, None, options)
                return dataclasses.replace(res, log=f"CBC retried without warm start/priorities after: {first}\n" + res.log)
            except SolverError:
                try:
                    import highspy  # noqa: F401
                except ImportError:
                    raise first from None
                res = _solve_highs(model, time_limit_s, gap_rel, gap_abs, threads, warm_start, feas_tol, None)
                return dataclasses.replace(res, log=f"CBC failed ({first}); solved with HiGHS\n" + res.log)
    if priorities and any(model.col_int):
        return _branch_on_priorities(
            model, priorities, time_limit_s, gap_rel, gap_abs, threads, warm_start, feas_tol, highs_options
        )
    return _solve_highs(model, time_limit_s, gap_rel, gap_abs, threads, warm_start, feas_tol, highs_options)


# ---------------------------------------------------------------------------------------------------------
# CBC through PuLP
# ---------------------------------------------------------------------------------------------------------
def _cbc_path() -> str | None:
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
    return out


def _solve_cbc(
    model: MilpModel,
    time_limit_s: float | None,
    gap_rel: float,
    gap_abs: float,
    threads: int | None,
    warm_start: Sequence[float] | None,
    feas_tol: float,
    priorities: Mapping[int, int] | None = None,
    extra_options: Sequence[str] = (),
) -> SolveResult:
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
    if warm_start is not None:
        for v, x0 in zip(cols, warm_start):
            v.setInitialValue(float(x0), check=False)
    options = [
        "randomCbcSeed 1",
        "randomSeed 1",
        f"primalTolerance {feas_tol:g}",
        f"integerTolerance {max(feas_tol, 1e-9):g}",
    ]
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
            path=_cbc_path(),
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
            raise limits.SolveInterrupted(None) from None
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
    elif result.startswith("Stopped on time") or "time" in result.lower():
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
    return SolveResult(status, x, objective, bound, gap, solve_s, "cbc", result or pulp.LpStatus[prob.status], log)


# ---------------------------------------------------------------------------------------------------------
# HiGHS through highspy
# ---------------------------------------------------------------------------------------------------------
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


def _solve_highs(
    model: MilpModel,
    time_limit_s: float | None,
    gap_rel: float,
    gap_abs: float,
    threads: int | None,
    warm_start: Sequence[float] | None,
    feas_tol: float,
    highs_options: Mapping[str, Any] | None = None,
) -> SolveResult:
    import highspy

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
        res = _solve_highs(model, time_limit_s, gap_rel, gap_abs, threads, None, feas_tol, highs_options)
        return dataclasses.replace(res, solve_s=res.solve_s + solve_s, log="HiGHS re-run without the warm start: its "
                                   "solution vector was the warm start, not the better objective it reported")
    if ms == highspy.HighsModelStatus.kOptimal:
        status = OPTIMAL
        bound = float(info.mip_dual_bound) if mip else objective
        bound = min(bound, objective)
    elif ms == highspy.HighsModelStatus.kInfeasible:
        status, x, objective, bound = INFEASIBLE, None, INF, INF
    elif ms in (highspy.HighsModelStatus.kTimeLimit, highspy.HighsModelStatus.kInterrupt):
        status = TIME_LIMIT
        bound = float(info.mip_dual_bound) if mip else -INF
        if x is not None:
            bound = min(bound, objective)
    else:
        status, bound = (TIME_LIMIT if x is not None else ERROR), (float(info.mip_dual_bound) if mip else -INF)
    gap = relative_gap(objective, bound) if x is not None else INF
    res = SolveResult(status, x, objective, bound, gap, solve_s, "highs", raw)
    if interrupted:
        raise limits.SolveInterrupted(res)
    return res


def interrupted_result(
    result: SolveResult | None, model: MilpModel, warm_start: Sequence[float] | None, solver: str
) -> SolveResult:
    """The best solution when Ctrl-C stopped a search (``status="interrupted"``): the solver's own, else the warm
    start; :class:`limits.SolveInterrupted` again when there is neither."""
    if result is not None and result.x is not None:
        return dataclasses.replace(result, status=INTERRUPTED)
    if warm_start is None or model.max_violation(warm_start) > 1e-6:
        raise limits.SolveInterrupted(result)
    obj = model.evaluate(warm_start)
    bound = result.bound if result is not None and math.isfinite(result.bound) else -INF
    return SolveResult(INTERRUPTED, list(warm_start), obj, min(bound, obj), relative_gap(obj, bound), 0.0, solver,
                       "interrupted (the heuristic plan)")


def _with_bounds(model: MilpModel, lb: Mapping[int, float], ub: Mapping[int, float]) -> MilpModel:
    m = MilpModel(**{k: (list(v) if isinstance(v, list) else v) for k, v in model.__dict__.items()})
    for j, v in lb.items():
        m.col_lb[j] = max(m.col_lb[j], v)
    for j, v in ub.items():
        m.col_ub[j] = min(m.col_ub[j], v)
    return m


def _branch_on_priorities(
    model: MilpModel,
    priorities: Mapping[int, int],
    time_limit_s: float | None,
    gap_rel: float,
    gap_abs: float,
    threads: int | None,
    warm_start: Sequence[float] | None,
    feas_tol: float,
    highs_options: Mapping[str, Any] | None,
    max_nodes: int = 64,
) -> SolveResult:
    """HiGHS has no branching priorities: branch on the priority columns here (depth first, LP bounds),
    then solve each leaf (all priority columns integral in its LP) with HiGHS's MILP under the incumbent as
    cutoff. Exact: the returned bound is the minimum over pruned and solved leaves.

    Used for the count columns of repeated blocks, whose LP relaxation is weak only in *how many* blocks
    are checkpointed: once that count is fixed the LP bound is (nearly) tight.
    """
    t0 = time.perf_counter()
    order = sorted(priorities, key=lambda j: (priorities[j], j))
    best_x = list(warm_start) if warm_start is not None else None
    best = model.evaluate(best_x) if best_x is not None and model.max_violation(best_x) <= 1e-6 else INF
    if best == INF:
        best_x = None
    leaf_bounds: list[float] = []
    status_time = False
    nodes = 0
    # entries: (lower bounds, upper bounds, LP bound of the parent node)
    stack: list[tuple[dict[int, float], dict[int, float], float]] = [({}, {}, -INF)]
    hopts = dict(highs_options or {})

    def left() -> float | None:
        own = None if time_limit_s is None else time_limit_s - (time.perf_counter() - t0)
        end = limits.remaining()
        return own if end is None else (end if own is None else min(own, end))

    def summary() -> SolveResult:
        solve_s = time.perf_counter() - t0
        if best_x is None:
            if status_time:
                return SolveResult(TIME_LIMIT, None, INF, -INF, INF, solve_s, "highs", "time limit")
            return SolveResult(INFEASIBLE, None, INF, INF, INF, solve_s, "highs", "Infeasible")
        bound = min([best] + leaf_bounds + [b for _, _, b in stack])
        gap = relative_gap(best, bound)
        status = TIME_LIMIT if status_time and gap > gap_rel else OPTIMAL
        return SolveResult(status, best_x, best, bound, gap, solve_s, "highs", f"{status} ({nodes} count nodes)")

    def prune_at(v: float) -> bool:
        return best < INF and v >= best - max(gap_abs, gap_rel * abs(best))

    while stack:
        lb, ub, parent_bound = stack.pop()
        rem = left()
        if nodes > 0 and ((rem is not None and rem <= 0) or limits.expired()):
            status_time = True
            leaf_bounds.append(parent_bound)
            continue
        sub = _with_bounds(model, lb, ub)
        relax = MilpModel(**{k: (list(v) if isinstance(v, list) else v) for k, v in sub.__dict__.items()})
        relax.col_int = [False] * relax.num_cols
        try:
            lp = _solve_highs(relax, rem, 0.0, 0.0, threads, None, feas_tol, None)
        except limits.SolveInterrupted:
            stack.append((lb, ub, parent_bound))
            status_time = True
            raise limits.SolveInterrupted(summary()) from None
        nodes += 1
        if lp.status == INFEASIBLE:
            continue
        if lp.x is None:
            leaf_bounds.append(parent_bound)
            status_time = status_time or lp.status == TIME_LIMIT
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
                res = _solve_highs(sub, left(), gap_rel, gap_abs, threads, ws, feas_tol, opts)
        except limits.SolveInterrupted as e:
            leaf = e.result
            if leaf is not None and leaf.x is not None and leaf.objective < best:
                best, best_x = leaf.objective, leaf.x
            leaf_bounds.append(lp.objective if leaf is None or not math.isfinite(leaf.bound) else max(lp.objective, min(leaf.bound, best)))
            status_time = True
            raise limits.SolveInterrupted(summary()) from None
        if res.status == INFEASIBLE:
            # nothing better than the cutoff (or truly infeasible) in this leaf
            leaf_bounds.append(best if best < INF else INF)
            continue
        if res.x is not None and res.objective < best:
            best, best_x = res.objective, res.x
        leaf_bounds.append(max(lp.objective, res.bound) if res.x is not None or res.status == OPTIMAL else lp.objective)
        status_time = status_time or res.status == TIME_LIMIT
        if best_x is not None:
            limits.report(best, min([best] + leaf_bounds + [b for _, _, b in stack]),
                          relative_gap(best, min([best] + leaf_bounds + [b for _, _, b in stack])))
    return summary()


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
            obj, x = root_bound, None
            if best - obj <= tol:
                closed.append(obj)
                nodes += 1
                continue
        sub = _with_bounds(model, lb, ub)
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


def lp_solver(solver: str) -> str:
    """Auxiliary problems (the heuristic's LPs, op-level knapsacks) run in-process with HiGHS when highspy is
    installed (a CBC call costs a subprocess and an MPS file each); the module-level MILP always runs on
    the solver asked for."""
    try:
        import highspy  # noqa: F401

        return "highs"
    except ImportError:  # pragma: no cover - depends on the environment
        return solver


def relaxed(model: MilpModel) -> MilpModel:
    """A copy of ``model`` with every column continuous (its LP relaxation)."""
    lp = MilpModel(**{k: (list(v) if isinstance(v, list) else v) for k, v in model.__dict__.items()})
    lp.col_int = [False] * model.num_cols
    return lp


def relaxed_with_fixed(model: MilpModel, values: Mapping[int, float]) -> MilpModel:
    """The LP relaxation of ``model`` with the given columns fixed to the given values."""
    m = relaxed(model)
    for j, v in values.items():
        m.col_lb[j] = m.col_ub[j] = float(v)
    return m

