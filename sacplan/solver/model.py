"""The solver-neutral MILP (:class:`MilpModel`, always *minimise*), how a back-end runs it (:class:`RunSettings`),
what it returns (:class:`SolveResult`, normalised statuses, Ctrl-C as :class:`SolveInterrupted`), and copies with
changed bounds (:func:`with_bounds`, :func:`relaxed`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np


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
            "integer_columns": sum(self.col_int),
            "rows": self.num_rows,
            "nonzeros": self.num_nonzeros,
        }


@dataclass(frozen=True)
class RunSettings:
    """How one back-end run goes (what :func:`~sacplan.solver.backends.solve_model` hands CBC or HiGHS).

    Attributes:
        time_limit_s: wall-clock limit (s; None: none): the safety net.
        gap_rel, gap_abs: stop once the relative / absolute gap (objective units: ms) is this small.
        threads: solver threads (None: one, deterministic).
        warm_start: a full column vector to start from (a feasible incumbent helps a lot), or None.
        feas_tol: primal feasibility tolerance (model units: GiB for the SAC rows).
        node_limit: branch-and-bound nodes the run may explore (None: none); deterministic, unlike the time limit.
    """

    time_limit_s: float | None = None
    gap_rel: float = 1e-4
    gap_abs: float = 1e-9
    threads: int | None = None
    warm_start: Sequence[float] | None = None
    feas_tol: float = 1e-9
    node_limit: int | None = None


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
    #: branch-and-bound nodes explored (what the run charged to the call's work budget)
    nodes: int = 0
    #: what cut the run short: "" (nothing), ``limits.WORK_LIMIT`` (deterministic) or ``limits.WALL_CLOCK``
    stopped_by: str = ""


class SolveInterrupted(KeyboardInterrupt):
    """Ctrl-C during a solve; ``result`` is the solver's best result so far (or None)."""

    def __init__(self, result: SolveResult | None = None) -> None:
        super().__init__("solve interrupted")
        self.result = result


def relative_gap(objective: float, bound: float) -> float:
    """``|objective - bound| / max(|objective|, 1e-10)``, 0 when both are 0 (the convention of CBC/HiGHS)."""
    if not (math.isfinite(objective) and math.isfinite(bound)):
        return INF
    diff = max(0.0, objective - bound)
    if diff <= 1e-12:
        return 0.0
    return diff / max(abs(objective), 1e-10)


def interrupted_result(
    result: SolveResult | None, model: MilpModel, warm_start: Sequence[float] | None, solver: str
) -> SolveResult:
    """The best solution when Ctrl-C stopped a search (``status="interrupted"``): the solver's own, else the
    feasible warm start; :class:`SolveInterrupted` again when neither."""
    if result is not None and result.x is not None:
        return dataclasses.replace(result, status=INTERRUPTED)
    if warm_start is None or model.max_violation(warm_start) > 1e-6:
        raise SolveInterrupted(result)
    obj = model.evaluate(warm_start)
    bound = result.bound if result is not None and math.isfinite(result.bound) else -INF
    return SolveResult(INTERRUPTED, list(warm_start), obj, min(bound, obj), relative_gap(obj, bound), 0.0, solver,
                       "interrupted (the heuristic plan)")


def with_bounds(model: MilpModel, lb: Mapping[int, float], ub: Mapping[int, float]) -> MilpModel:
    """A copy of ``model`` with column bounds tightened: ``col_lb[j] >= lb[j]``, ``col_ub[j] <= ub[j]``."""
    m = MilpModel(**{k: (list(v) if isinstance(v, list) else v) for k, v in model.__dict__.items()})
    for j, v in lb.items():
        m.col_lb[j] = max(m.col_lb[j], v)
    for j, v in ub.items():
        m.col_ub[j] = min(m.col_ub[j], v)
    return m


def relaxed(model: MilpModel, fixed: Mapping[int, float] | None = None) -> MilpModel:
    """A copy of ``model`` with every column continuous (its LP relaxation), the ``fixed`` columns fixed to their
    values."""
    lp = with_bounds(model, {}, {})
    lp.col_int = [False] * model.num_cols
    for j, v in (fixed or {}).items():
        lp.col_lb[j] = lp.col_ub[j] = float(v)
    return lp
