"""Exact-byte repair of a decision (:func:`repair`)."""

from __future__ import annotations

import numpy as np

from sacplan.solver.problem import SacProblem


def repair(
    problem: SacProblem, y: np.ndarray, r: np.ndarray, budget: float, max_iter: int | None = None
) -> np.ndarray | None:
    """Raise discard ratios of checkpointed modules until every event fits ``budget`` exactly in bytes.

    Solvers work to a feasibility tolerance (~1 byte here); this removes such tiny violations (it only
    ever raises ratios, which lowers every event). Returns the repaired ratios, or None if impossible.
    """
    r = r.copy()
    C, _ = problem.linear_terms()
    max_iter = max_iter or (4 * len(problem.ev_base) + 16)
    for _ in range(max_iter):
        m = problem.peaks(y, r)
        e = int(np.argmax(m))
        viol = m[e] - budget
        if viol <= 0:
            return r
        weight = C[e]  # bytes each slot's calls free at this event at ratio 1 (0 everywhere at an 'other' event)
        room = weight * (1.0 - r) * (y > 0.5)
        if room.sum() < viol:
            return None
        s = int(np.argmax(room))
        r[s] = min(1.0, r[s] + (viol * (1 + 1e-12) + 1e-3) / weight[s])
    return None
