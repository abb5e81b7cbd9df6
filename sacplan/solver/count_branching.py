"""Branching on the count columns of classes of identical candidates (how many blocks are checkpointed, how many
reach each option level): their LP relaxation is weak only in *how many*, so once a count is fixed the LP bound is
(nearly) tight and the symmetric search over *which* blocks never starts. Two depth-first searches on LP bounds,
branching alike (:func:`_branch`):

* :func:`prove_by_lp_branching`: proves an incumbent optimal with LPs alone, or gives up where a node needs a MILP;
* :func:`branch_on_priorities`: the branching priorities HiGHS lacks: priority columns branched here, each leaf
  (those columns integral in its LP) solved by HiGHS's MILP under the incumbent as cutoff; the bound is the minimum
  over pruned and solved leaves. Work counted (one node per LP, plus the leaf MILPs' nodes): deterministic.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Mapping, Sequence

from sacplan.solver import backends, limits, progress
from sacplan.solver.model import (
    INF, INFEASIBLE, OPTIMAL, TIME_LIMIT, MilpModel, RunSettings, SolveInterrupted, SolveResult, relative_gap, relaxed,
    with_bounds,
)

#: one node of the search: (lower bounds, upper bounds, LP bound of the parent node)
Node = tuple[dict[int, float], dict[int, float], float]
#: LPs :func:`prove_by_lp_branching` may solve before the MILP takes over
PROOF_NODES = 16
#: LPs :func:`branch_on_priorities` may branch over before the rest are solved as leaves
COUNT_NODES = 64


def _fractional(x: Sequence[float], cols: Sequence[int]) -> int | None:
    """The first of ``cols`` whose value in ``x`` is fractional (None: all integral)."""
    return next((j for j in cols if abs(x[j] - round(x[j])) > 1e-6), None)


def _branch(lb: dict[int, float], ub: dict[int, float], j: int, v: float, bound: float) -> list[Node]:
    """The two nodes of branching column ``j`` at its fractional value ``v`` (``x_j ≤ ⌊v⌋`` and ``x_j ≥ ⌈v⌉``, each
    with its parent's LP ``bound``) in stack order: the side nearer ``v`` is popped first, by both searches."""
    down, up = (lb, {**ub, j: float(math.floor(v))}, bound), ({**lb, j: float(math.ceil(v))}, ub, bound)
    return [up, down] if v - math.floor(v) < 0.5 else [down, up]


def prove_by_lp_branching(
    model: MilpModel,
    incumbent: Sequence[float] | None,
    branch_cols: Sequence[int],
    *,
    gap_rel: float,
    backend: str,
    root_bound: float | None = None,
) -> SolveResult | None:
    """``incumbent`` proven optimal within the gap by LP relaxations alone (``backend``'s LP solver), branching
    only on ``branch_cols``: a node closes when its LP bound reaches the incumbent. None when a node's LP is
    integral in those columns yet below the incumbent, or after :data:`PROOF_NODES` LPs: the MILP takes over."""
    if incumbent is None:
        return None
    best = model.evaluate(incumbent)
    tol = max(1e-9, gap_rel * abs(best))
    t0 = time.perf_counter()
    closed: list[float] = []
    stack: list[Node] = [({}, {}, -INF)]
    nodes = 0
    while stack:
        lb, ub, _ = stack.pop()
        if nodes == 0 and root_bound is not None:
            obj = root_bound
            if best - obj <= tol:
                closed.append(obj)
                nodes += 1
                continue
        if nodes >= PROOF_NODES:
            return None
        res = backends.solve_model(relaxed(with_bounds(model, lb, ub)), backends.lp_solver(backend))
        nodes += 1
        if res.status == INFEASIBLE:
            continue
        if res.x is None:
            return None
        if best - res.objective <= tol:
            closed.append(res.objective)
            continue
        frac = _fractional(res.x, branch_cols)
        if frac is None:
            return None
        stack += _branch(lb, ub, frac, res.x[frac], res.objective)
    bound = min([best] + closed)
    return SolveResult(
        OPTIMAL, list(incumbent), best, bound, relative_gap(best, bound), time.perf_counter() - t0, backend,
        f"optimal (incumbent meets the LP bounds of {nodes} count node(s))",
    )


def branch_on_priorities(model: MilpModel, priorities: Mapping[int, int], run: RunSettings) -> SolveResult:
    """Solve ``model`` by branching on the ``priorities`` columns (smaller first) for at most :data:`COUNT_NODES`
    LPs, then HiGHS's MILP at the leaves (see the module docstring)."""
    search = _CountSearch(model, priorities, run)
    while search.stack:
        search.step()
    return search.summary()


class _CountSearch:
    """The state of one search: the incumbent, the closed leaves' bounds, the open nodes, the work done."""

    def __init__(self, model: MilpModel, priorities: Mapping[int, int], run: RunSettings) -> None:
        self.model, self.run = model, run
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

    def step(self) -> None:
        """Pop one node: close it on its LP bound, branch on its first fractional priority column, or solve it
        as a leaf."""
        lb, ub, parent_bound = self.stack.pop()
        if self.nodes > 0 and self.out_of_work():
            self.leaf_bounds.append(parent_bound)
            return
        sub = with_bounds(self.model, lb, ub)
        try:
            lp = backends.solve_highs(relaxed(sub), RunSettings(self.left(), 0.0, 0.0, self.run.threads, None, self.run.feas_tol))
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
        frac = _fractional(lp.x, self.order)
        if frac is not None and self.nodes < COUNT_NODES:
            self.stack += _branch(lb, ub, frac, lp.x[frac], lp.objective)
            return
        self.leaf(sub, lp)

    def leaf(self, sub: MilpModel, lp: SolveResult) -> None:
        """Solve a leaf (priority columns integral in its LP ``lp``) by HiGHS's MILP under the incumbent."""
        ws = self.best_x if self.best_x is not None and sub.max_violation(self.best_x) <= 1e-6 else None
        opts = {}
        if self.best < INF:
            opts["objective_bound"] = self.best + max(self.run.gap_abs, 1e-9 * abs(self.best))
        try:
            with progress.within(self.best, self.open_bound()):
                res = backends.solve_highs(sub, dataclasses.replace(self.run, time_limit_s=self.left(), warm_start=ws,
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
