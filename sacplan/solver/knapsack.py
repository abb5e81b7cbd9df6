"""The 0/1 knapsack of one module's free op groups at one byte budget, and the :class:`OpSelection` it yields.

Per module call, over the free groups of :func:`~sacplan.opgroups.split_groups` (the always-saved ones taken
first): ``x_g ∈ {0, 1}`` saves group ``g``'s outputs, ``Σ_g x_g · bytes_g ≤ max_saved_bytes - always-saved bytes``,
minimise ``Σ_{g: x_g = 0} ms_g`` (ops at or after ``recompute_stop`` are never re-run: not counted). Where the LP
relaxation (:class:`GreedyFill`, by ms per byte) ends on a whole group it is integral and optimal; else the MILP is
solved exactly (:func:`knapsack`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from sacplan.errors import InfeasibleBudgetError
from sacplan.solver import limits
from sacplan.solver.backends import solve_model
from sacplan.opgroups import OpGroup, fill_order
from sacplan.solver.model import OPTIMAL, MilpModel
from sacplan.stats import OpStat


@dataclass(frozen=True)
class OpSelection:
    """Ops to save inside one checkpointed module (per call).

    Attributes:
        saved: indices (``OpStat.index``) of the ops whose outputs are saved, ascending.
        saved_bytes: ``Σ save_cost_bytes`` of the saved ops.
        recompute_ms: runtime of the recomputed ops with index < ``recompute_stop``.
        recompute_flops: FLOPs of those ops.
    """

    saved: tuple[int, ...]
    saved_bytes: int
    recompute_ms: float
    recompute_flops: int


def selection_of(ops: Sequence[OpStat], saved_pos: set[int], stop: int) -> OpSelection:
    """The :class:`OpSelection` saving the ops at positions ``saved_pos`` of ``ops`` (priced with ``math.fsum``
    over the recomputed ops before ``stop``)."""
    saved = tuple(sorted(ops[p].index for p in saved_pos))
    sb = sum(max(0, int(ops[p].save_cost_bytes)) for p in saved_pos)
    rec = [op for p, op in enumerate(ops) if p not in saved_pos and op.index < stop]
    return OpSelection(
        saved=saved,
        saved_bytes=sb,
        recompute_ms=math.fsum(op.runtime_ms for op in rec),
        recompute_flops=int(sum(op.flops for op in rec)),
    )


#: Branch-and-bound nodes one op-level knapsack MILP may explore (its own deterministic limit, not drawn from the
#: call's work budget: a module's options solve hundreds of these small knapsacks)
KNAPSACK_NODES = 10_000


def knapsack(fill: "GreedyFill", cap: int, solver: str, safety_net: str | None = None) -> tuple[OpSelection, float]:
    """The 0/1 knapsack at ``cap`` saved bytes over ``fill``'s split, and its slack (ms per call): 0 when optimal,
    else (the greedy fill fractional, and the MILP stopped or the wall-clock safety net fired, recorded at
    ``safety_net``; None: always solved) what the LP relaxation saves beyond it: no save list under ``cap``
    recomputes less than ``selection.recompute_ms - slack``."""
    # LP relaxation of the knapsack: take groups by ms per byte; integral => optimal. A fill that uses the room
    # exactly is integral too (the next group's fraction is 0): the trade-off's greedy vertices are such fills,
    # so module_options needs no MILP for them (Mistral-7B's decoder stack: 989 of its 991 sampled ratios).
    mask, slack = fill.take(cap)
    if slack <= 0 or (safety_net is not None and limits.past_deadline(safety_net)):
        return fill.selection(mask), slack
    # Exact 0/1 knapsack by MILP over the groups that fit (in op order); the greedy fill is a feasible warm start.
    room = cap - fill.used
    take = [fill.order[k] for k in np.nonzero(mask[:-1])[0].tolist()]  # in density order, as the fill took them
    taken = set(take)
    cand = [i for i, g in enumerate(fill.groups) if g.bytes <= room]
    model = MilpModel(name="sacplan_ops")
    # Scale bytes to the budget so coefficients are O(1); maximise saved ms == minimise -saved ms.
    scale = float(room)
    cols = [model.add_col(f"x{k}", 0.0, 1.0, True, -fill.groups[i].ms) for k, i in enumerate(cand)]
    model.add_row("bytes", cols, [fill.groups[i].bytes / scale for i in cand], ub=1.0)
    warm = [1.0 if i in taken else 0.0 for i in cand]
    res = solve_model(model, solver, gap_rel=0.0, gap_abs=1e-9, warm_start=warm, node_limit=KNAPSACK_NODES,
                      shared=False)
    if res.status != OPTIMAL or res.x is None:  # its node limit, or the wall-clock safety net: the greedy fill
        chosen = take
        if math.isfinite(res.bound):  # the solver's bound on saved ms, when tighter than the LP's
            slack = max(0.0, min(slack, -res.bound - sum(fill.groups[i].ms for i in take)))
    else:
        slack = 0.0
        chosen = [cand[k] for k, v in enumerate(res.x) if v > 0.5]
        # Guard the byte budget exactly (the solver works in scaled floats).
        if sum(fill.groups[i].bytes for i in chosen) > room:
            chosen = take
    saved = {p for g in fill.always_groups for p in g.members} | {p for i in chosen for p in fill.groups[i].members}
    return selection_of(fill.ops, saved, fill.stop), slack


class GreedyFill:
    """The greedy fill of one module's split (``always`` saved groups, ``free`` ones): free groups in turn by ms per
    byte while they fit, the knapsack's LP relaxation. Built once, each capacity then costs a few vector operations
    (a stage of 32 decoder blocks is sampled at ~1000 ratios)."""

    def __init__(self, ops: tuple[OpStat, ...], always: Sequence[OpGroup], free: Sequence[OpGroup], stop: int) -> None:
        self.ops, self.stop, self.groups, self.always_groups = ops, stop, list(free), list(always)
        #: free groups (indices into ``free``) in the greedy order (:func:`~sacplan.opgroups.fill_order`)
        self.order = fill_order(free)
        self.free = [free[i] for i in self.order]
        self.bytes = np.array([g.bytes for g in self.free], dtype=np.int64)
        self.ms = np.array([g.ms for g in self.free], dtype=float)
        self.used = sum(g.bytes for g in always)
        n = len(ops)
        self.group = np.full(n, -1, dtype=np.int64)  # position -> its free group's rank in density order
        for k, g in enumerate(self.free):
            self.group[list(g.members)] = k
        self.always = np.zeros(n, dtype=bool)
        for g in always:
            self.always[list(g.members)] = True
        self.index = np.array([op.index for op in ops], dtype=np.int64)
        self.runtime = np.array([float(op.runtime_ms) for op in ops], dtype=float)
        flops = [int(op.flops) for op in ops]
        # int64 sums when no sum can overflow (a 7B stage: ~1e17 FLOPs), else Python ints
        self.flops: np.ndarray | list[int] = np.array(flops, dtype=np.int64) if sum(map(abs, flops)) < 2**62 else flops
        self.before_stop = self.index < stop

    def take(self, cap: int) -> tuple[np.ndarray, float]:
        """The fill at ``cap`` saved bytes: the free groups it takes (a mask over density ranks, one entry more:
        False) and its slack (ms): 0 when it ends on a whole group, else what the LP relaxation saves beyond it.

        Raises:
            InfeasibleBudgetError: the always-saved groups alone hold more than ``cap``."""
        if self.used > cap:
            raise InfeasibleBudgetError(
                cap, self.used, "(op level: the in-place/random ops that must be saved hold more than max_saved_bytes)"
            )
        room = cap - self.used
        fits = np.nonzero(self.bytes <= room)[0]  # the knapsack's items, in density order
        cum = np.cumsum(self.bytes[fits])
        k = int(np.searchsorted(cum, room, side="right"))  # items fit in turn until the first one that does not
        take = np.zeros(len(self.free) + 1, dtype=bool)
        take[fits[:k]] = True
        left = room - (int(cum[k - 1]) if k else 0)
        slack = 0.0
        if k < len(fits) and left > 0:
            nxt = int(fits[k])
            slack = left * float(self.ms[nxt]) / float(self.bytes[nxt])
        return take, slack

    def selection(self, take: np.ndarray) -> OpSelection:
        """The :class:`OpSelection` of a fill's mask ``take`` (:meth:`take`)."""
        saved = self.always | take[self.group]  # group -1 (not free) reads the last entry: False
        rec = ~saved & self.before_stop
        return OpSelection(
            saved=tuple(sorted(self.index[saved].tolist())),
            saved_bytes=int(self.used + int(self.bytes[take[:-1]].sum())),
            recompute_ms=math.fsum(self.runtime[rec].tolist()),
            recompute_flops=(int(self.flops[rec].sum()) if isinstance(self.flops, np.ndarray)
                             else sum(f for f, r in zip(self.flops, rec.tolist()) if r)),
        )
