"""Branching on class counts for HiGHS (:func:`branch_on_priorities`), which has no branching priorities.

The count columns of repeated blocks make the LP relaxation weak only in *how many* blocks are checkpointed: once
that count is fixed the LP bound is (nearly) tight. So the priority columns are branched on here (depth first, LP
bounds, the nearer side first), and each leaf (all priority columns integral in its LP) is solved by HiGHS's
MILP under the incumbent as cutoff. Exact: the returned bound is the minimum over pruned and solved leaves.
Work is counted (one node per LP, plus each leaf MILP's own nodes) against ``run.node_limit``: deterministic.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Mapping

from sacplan.solver import limits, progress
from sacplan.solver.highs import solve_highs
from sacplan.solver.model import (
    INF, INFEASIBLE, OPTIMAL, TIME_LIMIT, MilpModel, RunSettings, SolveInterrupted, SolveResult, relative_gap,
    with_bounds,
)

#: one node of the search: (lower bounds, upper bounds, LP bound of the parent node)
Node = tuple[dict[int, float], dict[int, float], float]


def branch_on_priorities(
    model: MilpModel,
    priorities: Mapping[int, int],
    run: RunSettings,
    highs_options: Mapping[str, Any] | None,
    max_nodes: int = 64,
) -> SolveResult:
    """Solve ``model`` by branching on the ``priorities`` columns (smaller first) for at most ``max_nodes`` LPs,
    then HiGHS's MILP at the leaves (see the module docstring)."""
    search = _CountSearch(model, priorities, run, highs_options)
    while search.stack:
        search.step(max_nodes)
    return search.summary()


class _CountSearch:
    """The state of one search: the incumbent, the closed leaves' bounds, the open nodes, the work done."""

    def __init__(self, model: MilpModel, priorities: Mapping[int, int], run: RunSettings,
                 highs_options: Mapping[str, Any] | None) -> None:
        self.model, self.run, self.hopts = model, run, dict(highs_options or {})
        self.t0 = time.perf_counter()
        self.order = sorted(priorities, key=lambda j: (priorities[j], j))
        ws = run.warm_start
        self.best_x = list(ws) if ws is not None else None
        self.best = model.evaluate(self.best_x) if self.best_x is not None and model.max_violation(self.best_x) <= 1e-6 else INF
        if self.best == INF:
            self.best_x = None
        self.leaf_bounds: list[float] = []
        self.stop = ""  # what cut the search short: "" or limits.WORK_LIMIT / limits.WALL_CLOCK
        self.nodes = 0  # LPs solved here plus the leaf MILPs' nodes: the work charged (deterministic)
        self.stack: list[Node] = [({}, {}, -INF)]

    def left(self) -> float | None:
        own = None if self.run.time_limit_s is None else self.run.time_limit_s - (time.perf_counter() - self.t0)
        end = limits.remaining()
        return own if end is None else (end if own is None else min(own, end))

    def nodes_left(self) -> int | None:
        return None if self.run.node_limit is None else max(0, self.run.node_limit - self.nodes)

    def out_of_work(self) -> bool:
        """The node budget is spent (deterministic) or the wall clock ran out (safety net): record which."""
        n, rem = self.nodes_left(), self.left()
        if n is not None and n <= 0:
            self.stop = self.stop or limits.WORK_LIMIT
            return True
        if (rem is not None and rem <= 0) or limits.expired():
            self.stop = limits.WALL_CLOCK
            return True
        return False

    def open_bound(self) -> float:
        return min([self.best] + self.leaf_bounds + [b for _, _, b in self.stack])

    def summary(self) -> SolveResult:
        solve_s = time.perf_counter() - self.t0
        if self.best_x is None:
            if self.stop:
                return SolveResult(TIME_LIMIT, None, INF, -INF, INF, solve_s, "highs", self.stop, nodes=self.nodes,
                                   stopped_by=self.stop)
            return SolveResult(INFEASIBLE, None, INF, INF, INF, solve_s, "highs", "Infeasible", nodes=self.nodes)
        bound = self.open_bound()
        gap = relative_gap(self.best, bound)
        cut = bool(self.stop) and gap > self.run.gap_rel
        status = TIME_LIMIT if cut else OPTIMAL
        return SolveResult(status, self.best_x, self.best, bound, gap, solve_s, "highs",
                           f"{status} ({self.nodes} count nodes)", nodes=self.nodes, stopped_by=self.stop if cut else "")

    def prune_at(self, v: float) -> bool:
        return self.best < INF and v >= self.best - max(self.run.gap_abs, self.run.gap_rel * abs(self.best))

    def step(self, max_nodes: int) -> None:
        """Pop one node: close it on its LP bound, branch on its first fractional priority column, or solve it
        as a leaf."""
        lb, ub, parent_bound = self.stack.pop()
        if self.nodes > 0 and self.out_of_work():
            self.leaf_bounds.append(parent_bound)
            return
        sub = with_bounds(self.model, lb, ub)
        relax = MilpModel(**{k: (list(v) if isinstance(v, list) else v) for k, v in sub.__dict__.items()})
        relax.col_int = [False] * relax.num_cols
        try:
            lp = solve_highs(relax, RunSettings(self.left(), 0.0, 0.0, self.run.threads, None, self.run.feas_tol))
        except SolveInterrupted:
            self.stack.append((lb, ub, parent_bound))
            self.stop = limits.WALL_CLOCK
            raise SolveInterrupted(self.summary()) from None
        self.nodes += 1
        if lp.status == INFEASIBLE:
            return
        if lp.x is None:
            self.leaf_bounds.append(parent_bound)
            if lp.status == TIME_LIMIT:
                self.stop = limits.WALL_CLOCK
            return
        if self.prune_at(lp.objective):
            self.leaf_bounds.append(lp.objective)
            return
        frac = next((j for j in self.order if abs(lp.x[j] - round(lp.x[j])) > 1e-6), None)
        if frac is not None and self.nodes < max_nodes:
            v = lp.x[frac]
            down = (lb, {**ub, frac: float(math.floor(v))}, lp.objective)
            up = ({**lb, frac: float(math.ceil(v))}, ub, lp.objective)
            self.stack += [up, down] if v - math.floor(v) < 0.5 else [down, up]  # the nearer side first
            return
        self.leaf(sub, lp)

    def leaf(self, sub: MilpModel, lp: SolveResult) -> None:
        """Solve a leaf (priority columns integral in its LP ``lp``) by HiGHS's MILP under the incumbent."""
        ws = self.best_x if self.best_x is not None and sub.max_violation(self.best_x) <= 1e-6 else None
        opts = dict(self.hopts)
        if self.best < INF:
            opts["objective_bound"] = self.best + max(self.run.gap_abs, 1e-9 * abs(self.best))
        try:
            with progress.within(self.best, self.open_bound()):
                res = solve_highs(sub, dataclasses.replace(self.run, time_limit_s=self.left(), warm_start=ws,
                                                           node_limit=self.nodes_left()), opts)
        except SolveInterrupted as e:
            leaf = e.result
            if leaf is not None and leaf.x is not None and leaf.objective < self.best:
                self.best, self.best_x = leaf.objective, leaf.x
            self.leaf_bounds.append(lp.objective if leaf is None or not math.isfinite(leaf.bound)
                                    else max(lp.objective, min(leaf.bound, self.best)))
            self.stop = limits.WALL_CLOCK
            raise SolveInterrupted(self.summary()) from None
        self.nodes += res.nodes
        if res.status == INFEASIBLE:  # nothing better than the cutoff (or truly infeasible) in this leaf
            self.leaf_bounds.append(self.best if self.best < INF else INF)
            return
        if res.x is not None and res.objective < self.best:
            self.best, self.best_x = res.objective, res.x
        self.leaf_bounds.append(max(lp.objective, res.bound) if res.x is not None or res.status == OPTIMAL
                                else lp.objective)
        if res.stopped_by and self.stop != limits.WALL_CLOCK:
            self.stop = res.stopped_by
        if self.best_x is not None:
            progress.report(self.best, self.open_bound(), relative_gap(self.best, self.open_bound()))
