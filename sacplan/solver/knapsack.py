"""The 0/1 knapsack of one module's free op groups at one byte budget, and the :class:`OpSelection` it yields.

MILP (per module call, over the free groups of :func:`~sacplan.opgroups.split_groups`, the always-saved ones
taken first):

* ``x_g ∈ {0, 1}``: save group ``g``'s outputs (1) or recompute them (0);
* ``Σ_g x_g · bytes_g ≤ max_saved_bytes - (bytes of the always-saved groups)``;
* minimise ``Σ_{g: x_g = 0} ms_g``, where ``ms_g`` counts only ops before ``recompute_stop`` (ops at or after it
  are never re-run: non-reentrant checkpointing stops early once everything backward needs exists again).

When the knapsack's LP relaxation (greedy by ms per byte) ends on a whole group its solution is integral and
optimal, and no solver is called; otherwise the MILP is solved exactly (:func:`knapsack`). :class:`GreedyFill`
is the greedy fill at many capacities of one module at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from sacplan.errors import InfeasibleBudgetError
from sacplan.solver.backends import solve_model
from sacplan.opgroups import OpGroup
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
        solved: True when an MILP solve was needed (False: trivial or greedy-optimal).
    """

    saved: tuple[int, ...]
    saved_bytes: int
    recompute_ms: float
    recompute_flops: int
    solved: bool = False


def selection_of(ops: Sequence[OpStat], saved_pos: set[int], stop: int, solved: bool) -> OpSelection:
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
        solved=solved,
    )


#: Branch-and-bound nodes one op-level knapsack MILP may explore (its own deterministic limit, not drawn from the
#: call's work budget: a module's options solve hundreds of these small knapsacks)
KNAPSACK_NODES = 10_000


def knapsack(
    ops: tuple[OpStat, ...], always: Sequence[OpGroup], free: Sequence[OpGroup], cap: int, solver: str, stop: int,
    milp: bool = True,
) -> tuple[OpSelection, float]:
    """The 0/1 knapsack of :func:`~sacplan.solver.ops.select_ops` over groups already split by
    :func:`~sacplan.opgroups.split_groups`.

    Returns ``(selection, slack_ms)``: ``slack_ms`` is 0 when the selection is optimal, else (``milp=False``
    and the greedy fill was fractional) the ms per call the knapsack's LP relaxation saves beyond the greedy
    fill returned — no save list under ``cap`` recomputes less than ``selection.recompute_ms - slack_ms``."""
    saved = {p for g in always for p in g.members}
    used = sum(g.bytes for g in always)
    if used > cap:
        raise InfeasibleBudgetError(
            cap,
            used,
            "(op level: the in-place/random ops that must be saved hold more than max_saved_bytes)",
        )
    room = cap - used
    cand = [g for g in free if g.bytes <= room]
    if not cand:
        return selection_of(ops, saved, stop, False), 0.0
    # LP relaxation of the knapsack: take groups by ms per byte; integral => optimal. A fill that uses the room
    # exactly is integral too (the next group's fraction is 0): the trade-off's greedy vertices are such fills,
    # so module_options needs no MILP for them (Mistral-7B's decoder stack: 989 of its 991 sampled ratios).
    order = sorted(range(len(cand)), key=lambda i: (-cand[i].ms / cand[i].bytes, cand[i].bytes, i))
    left = room
    take: list[int] = []
    fractional = False
    slack = 0.0
    for i in order:
        g = cand[i]
        if g.bytes <= left:
            take.append(i)
            left -= g.bytes
        else:
            fractional = left > 0
            slack = left * g.ms / g.bytes
            break
    if not fractional or not milp:
        for i in take:
            saved.update(cand[i].members)
        return selection_of(ops, saved, stop, False), (slack if fractional else 0.0)
    # Exact 0/1 knapsack by MILP; the greedy fill is a feasible warm start.
    model = MilpModel(name="sacplan_ops")
    # Scale bytes to the budget so coefficients are O(1); maximise saved ms == minimise -saved ms.
    scale = float(room)
    cols = [model.add_col(f"x{i}", 0.0, 1.0, True, -g.ms) for i, g in enumerate(cand)]
    model.add_row("bytes", cols, [g.bytes / scale for g in cand], ub=1.0)
    warm = [0.0] * len(cand)
    for i in take:
        warm[i] = 1.0
    res = solve_model(model, solver, gap_rel=0.0, gap_abs=1e-9, warm_start=warm, node_limit=KNAPSACK_NODES,
                      shared=False)
    if res.status != OPTIMAL or res.x is None:  # its node limit, or the wall-clock safety net: the greedy fill
        chosen = take
        if math.isfinite(res.bound):  # the solver's bound on saved ms, when tighter than the LP's
            slack = max(0.0, min(slack, -res.bound - sum(cand[i].ms for i in take)))
    else:
        slack = 0.0
        chosen = [i for i, v in enumerate(res.x) if v > 0.5]
        # Guard the byte budget exactly (the solver works in scaled floats).
        if sum(cand[i].bytes for i in chosen) > room:
            chosen = take
    for i in chosen:
        saved.update(cand[i].members)
    return selection_of(ops, saved, stop, True), slack


class GreedyFill:
    """The greedy fill of :func:`knapsack` (``milp=False``) at many capacities over one module's split: the
    density order and per-op arrays are built once, each capacity then costs a few vector operations (a stage
    of 32 decoder blocks is sampled at ~1000 ratios)."""

    def __init__(self, ops: tuple[OpStat, ...], always: Sequence[OpGroup], free: Sequence[OpGroup], stop: int) -> None:
        order = sorted(range(len(free)), key=lambda i: (-free[i].ms / free[i].bytes, free[i].bytes, i))
        self.free = [free[i] for i in order]
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

    def __call__(self, cap: int) -> tuple[OpSelection, float]:
        """``(selection, slack_ms)`` as :func:`knapsack` returns them with ``milp=False``."""
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
        saved = self.always | take[self.group]  # group -1 (not free) reads the last entry: False
        rec = ~saved & self.before_stop
        sel = OpSelection(
            saved=tuple(sorted(self.index[saved].tolist())),
            saved_bytes=int(self.used + int(self.bytes[take[:-1]].sum())),
            recompute_ms=math.fsum(self.runtime[rec].tolist()),
            recompute_flops=(int(self.flops[rec].sum()) if isinstance(self.flops, np.ndarray)
                             else sum(f for f, r in zip(self.flops, rec.tolist()) if r)),
            solved=False,
        )
        return sel, slack
