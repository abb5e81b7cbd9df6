"""Realising a decision (:func:`realise`): each checkpointed module's discard ratio as a
:class:`~sacplan.plan.ModuleDecision` with its op save list."""

from __future__ import annotations

import math

import numpy as np

from sacplan.errors import InfeasibleBudgetError
from sacplan.opgroups import forced_saves
from sacplan.plan import ModuleDecision
from sacplan.sacmode import region_dispatch_ms
from sacplan.solver.backends import lp_solver
from sacplan.solver.candidates import Candidate
from sacplan.solver.knapsack import OpSelection
from sacplan.solver.ops import max_saved_bytes_for, select_ops
from sacplan.solver.options import SolverOptions
from sacplan.solver.problem import SacProblem


def per_module_peak(problem: SacProblem, m: np.ndarray) -> dict[str, int]:
    """Per module, the largest of the event bytes ``m`` (one per event, as :meth:`SacProblem.peaks` gives them)
    at its events, rounded up to whole bytes."""
    out: dict[str, float] = {}
    for mod, v in zip(problem.ev_module, m):
        if v > out.get(mod, -math.inf):
            out[mod] = float(v)
    return {k: int(math.ceil(v - 1e-6)) for k, v in sorted(out.items())}


def realise(
    problem: SacProblem, y: np.ndarray, r: np.ndarray, opts: SolverOptions
) -> tuple[list[ModuleDecision], np.ndarray, np.ndarray]:
    """The module decisions of ``(y, r)`` and the realised (y, r): the exact option the ratio picks, else op-level
    selection (``opts.op_level``) holding at most ``floor(A·(1 - r))`` bytes, so every event can only fall (at
    ratio 1 only ops that cost no bytes, such as the one making the module's output), else a full checkpoint (the
    ops that must be saved do not fit) or a ratio-only one."""
    decisions = []
    r_real = r.copy()
    for c in problem.candidates:
        if y[c.slot] >= 0.5:
            decisions.append(_decision(problem, c, float(min(1.0, max(0.0, r[c.slot]))), opts))
            r_real[c.slot] = decisions[-1].discard_ratio
    return decisions, y, r_real


def _selection(problem: SacProblem, c: Candidate, ratio: float, opts: SolverOptions) -> tuple[OpSelection | None, float]:
    """The save list realising ``ratio`` for candidate ``c`` (None: none, a full checkpoint at ratio 1 or a
    ratio-only decision) and the ratio, raised to 1 where a full checkpoint replaces the save list."""
    if not opts.op_level:
        return None, ratio
    st = problem.tree.nodes[c.node].stats
    options = problem.options(c.slot)
    if options is not None:
        sel = options.selection[options.level_for(ratio)]
        return sel, (1.0 if sel is None else ratio)
    if not st.ops:
        return None, ratio
    try:  # at ratio 1: save the free ops (what the trade-off's full discard costs)
        return select_ops(st.ops, max_saved_bytes_for(ratio, c.max_discard_bytes), solver=lp_solver(opts.backend),
                          recompute_stop=st.recompute_stop), ratio
    except InfeasibleBudgetError:
        return None, 1.0


def _decision(problem: SacProblem, c: Candidate, ratio: float, opts: SolverOptions) -> ModuleDecision:
    """Candidate ``c`` checkpointed at discard ``ratio``: a full checkpoint, its save list, or ratio-only."""
    st = problem.tree.nodes[c.node].stats
    t = st.tradeoff
    assert t is not None
    A = c.max_discard_bytes
    sel, ratio = _selection(problem, c, ratio, opts)

    def decision(saved_ops: tuple[tuple[int, str, int], ...] | None, **figures: float) -> ModuleDecision:
        # the selective mode's dispatch where apply runs the region under it (saved ops or buffers)
        dispatch = c.calls * region_dispatch_ms(st, problem.tree.stats.device, saved_ops)
        return ModuleDecision(fqn=c.fqn, calls=c.calls, preserve_rng_state=st.draws_random, saved_ops=saved_ops,
                              dispatch_ms=dispatch, **figures)

    if sel is None and ratio >= 1.0 - 1e-12:
        return decision(forced_saves(st.ops, st.recompute_stop), discard_ratio=1.0, discard_bytes=A,
                        recompute_ms=c.calls * c.recompute_ms, recompute_flops=c.calls * int(t.full_recompute_flops))
    if sel is not None:
        discard = A - sel.saved_bytes  # >= A·ratio by the byte budget of the selection
        by_index = {op.index: op for op in st.ops}
        return decision(tuple((i, by_index[i].name, by_index[i].occurrence) for i in sel.saved),
                        discard_ratio=discard / A, discard_bytes=discard, recompute_ms=c.calls * sel.recompute_ms,
                        recompute_flops=c.calls * sel.recompute_flops)
    # ratio-only decision: whole bytes, rounded up
    discard = int(math.ceil(ratio * A))
    r_real = max(ratio, min(1.0, discard / A))
    return decision(forced_saves(st.ops, st.recompute_stop), discard_ratio=float(r_real), discard_bytes=discard,
                    recompute_ms=c.cost(float(r_real)),
                    recompute_flops=int(round(c.calls * t.full_recompute_flops * c.fraction(float(r_real)))))
