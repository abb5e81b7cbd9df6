"""Realising the MILP's decision: each checkpointed module's discard ratio as an op save list, a module decision.

:func:`realise` turns ``(y, r)`` into :class:`~sacplan.plan.ModuleDecision` objects — the exact option the
ratio picks, or op-level selection (:func:`sacplan.solver.ops.select_ops`) at the ratio's byte budget, or a full
or ratio-only checkpoint — and the realised ratios, whose exact peaks the plan reports
(:func:`per_module_peak`).
"""

from __future__ import annotations

import math

import numpy as np

from sacplan.errors import InfeasibleBudgetError
from sacplan.opgroups import forced_saves
from sacplan.plan import ModuleDecision
from sacplan.solver.backends import lp_solver
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
    """Module decisions with op-level selection (``opts.op_level``); returns them and the realised (y, r).

    A ratio of 1 saves only ops that cost no bytes (an op making the module's output, kept anyway), or is a
    plain full checkpoint when there are none (a full checkpoint recomputes them too). Otherwise the ops saved hold at
    most ``floor(A·(1 - r))`` bytes, so the realised discard ``A - saved`` is at least ``A·r`` and every
    event's prediction can only fall. When the ops that must be saved (in-place inputs, random ops) do not
    fit, the module falls back to a full checkpoint (discards everything; costs the full recompute).
    """
    decisions = []
    op_level, solver = opts.op_level, opts.backend
    r_real = r.copy()
    for c in problem.candidates:
        s = c.slot
        if y[s] < 0.5:
            continue
        st = problem.tree.nodes[c.node].stats
        t = st.tradeoff
        assert t is not None
        A = c.max_discard_bytes
        ratio = float(min(1.0, max(0.0, r[s])))
        sel = None
        opts = problem.options(s)
        if opts is not None and op_level:
            sel = opts.selection[opts.level_for(ratio)]
            if sel is None:
                ratio = 1.0
        elif op_level and st.ops:  # at ratio 1: save the free ops (what the trade-off's full discard costs)
            try:
                sel = select_ops(
                    st.ops,
                    max_saved_bytes_for(ratio, A),
                    solver=lp_solver(solver),
                    recompute_stop=st.recompute_stop or None,
                )
            except InfeasibleBudgetError:
                ratio = 1.0
        if sel is None and ratio >= 1.0 - 1e-12:
            r_real[s] = 1.0
            decisions.append(
                ModuleDecision(
                    fqn=c.fqn,
                    discard_ratio=1.0,
                    discard_bytes=A,
                    recompute_ms=c.calls * c.recompute_ms,
                    recompute_flops=c.calls * int(t.full_recompute_flops),
                    saved_ops=forced_saves(st.ops, st.recompute_stop),
                    calls=c.calls,
                    preserve_rng_state=st.draws_random,
                )
            )
        elif sel is not None:
            discard = A - sel.saved_bytes  # >= A·ratio by the byte budget of the selection
            r_real[s] = discard / A
            by_index = {op.index: op for op in st.ops}
            decisions.append(
                ModuleDecision(
                    fqn=c.fqn,
                    discard_ratio=discard / A,
                    discard_bytes=discard,
                    recompute_ms=c.calls * sel.recompute_ms,
                    recompute_flops=c.calls * sel.recompute_flops,
                    saved_ops=tuple((i, by_index[i].name, by_index[i].occurrence) for i in sel.saved),
                    calls=c.calls,
                    preserve_rng_state=st.draws_random,
                )
            )
        else:  # ratio-only decision: whole bytes, rounded up
            discard = int(math.ceil(ratio * A))
            r_real[s] = max(ratio, min(1.0, discard / A))
            decisions.append(
                ModuleDecision(
                    fqn=c.fqn,
                    discard_ratio=float(r_real[s]),
                    discard_bytes=discard,
                    recompute_ms=c.cost(float(r_real[s])),
                    recompute_flops=int(round(c.calls * t.full_recompute_flops * c.fraction(float(r_real[s])))),
                    saved_ops=forced_saves(st.ops, st.recompute_stop),
                    calls=c.calls,
                    preserve_rng_state=st.draws_random,
                )
            )
    return decisions, y, r_real

