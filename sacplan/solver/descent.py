"""Local descent over option levels (:func:`improve`): a feasible exact-mode decision made cheaper, move by move.

Moves, best saving first, each checked exactly in bytes: a checkpointed module one option cheaper, or not
checkpointed at all; and where that alone does not fit, one to three options cheaper for it with as many options
more for another checkpointed module as that needs, when the pair saves time. Each check is a matrix-vector step
on :meth:`~sacplan.solver.problem.SacProblem.linear_terms`. The number of moves is bounded (deterministic).
"""

from __future__ import annotations

import numpy as np

from sacplan.solver import limits
from sacplan.solver.problem import SacProblem

#: Moves :func:`improve` may make per option level of the model (a deterministic bound on its work)
MOVES_PER_LEVEL = 2


def improve(
    problem: SacProblem, y: np.ndarray, r: np.ndarray, budget: float, max_moves: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(y, r)`` after the local descent; unchanged when a candidate has no exact options or it does not fit
    ``budget`` (bytes). Stops when no move saves, after ``max_moves`` (default :data:`MOVES_PER_LEVEL` per option
    level) or when the wall-clock safety net fires (recorded)."""
    nc = problem.num_candidates
    if nc == 0 or any(problem.options(s) is None for s in range(nc)):
        return y, r
    d = _Descent(problem, y, r, budget)
    if np.max(d.m) > d.lim:
        return d.y, d.r
    if max_moves is None:
        max_moves = MOVES_PER_LEVEL * sum(len(o.ratio) for o in d.opts) + 16
    for _ in range(max_moves):
        if limits.past_deadline("local descent"):
            break
        on = np.nonzero(d.lvl >= 0)[0]
        if not len(on):
            break
        moved, save = d.single(on)
        if not moved and not d.pair(on, save):
            break
    return d.y, d.r


class _Descent:
    """The descent's state: flags ``y``, ratios ``r``, option levels ``lvl`` (-1: not checkpointed) and event
    bytes ``m`` of the current decision, with the terms that price and check a move."""

    def __init__(self, problem: SacProblem, y: np.ndarray, r: np.ndarray, budget: float) -> None:
        C, Y = problem.linear_terms()
        if np.any(problem.ev_surge >= 0):  # each move checked against the largest surge its slot can add: safe
            Y = Y.copy()
            at = np.nonzero(problem.ev_surge >= 0)[0]
            Y[at, problem.ev_surge[at]] += problem.surge_top()[at]
        self.C, self.Y = C, Y
        nc = problem.num_candidates
        self.opts = [problem.options(s) for s in range(nc)]
        self.w = np.array([c.calls * c.recompute_ms for c in problem.candidates])
        self.y = (np.asarray(y, dtype=float) > 0.5).astype(float)
        self.lvl = np.array([self.opts[s].level_for(float(r[s])) if self.y[s] > 0.5 else -1 for s in range(nc)])
        self.ratios_of = [np.asarray(o.ratio) for o in self.opts]
        self.r = np.array([self.ratio(s, self.lvl[s]) for s in range(nc)])
        self.m = problem.ev_base - C @ self.r + Y @ self.y
        self.lim = budget + 1e-6

    def ratio(self, s: int, k: int) -> float:
        return 0.0 if k < 0 else self.opts[s].ratio[k]

    def qcost(self, s: int, k: int) -> float:
        return 0.0 if k < 0 else self.w[s] * self.opts[s].frac[k]

    def single(self, on: np.ndarray) -> tuple[bool, np.ndarray]:
        """The best single move (one level down, or off from level 0; or off from any level), taken when it fits;
        returns whether one was, and each checkpointed slot's saving one level down."""
        C, Y, m, r, lvl = self.C, self.Y, self.m, self.r, self.lvl
        down = np.array([lvl[s] - 1 for s in on])
        d_r = np.array([self.ratio(s, k) - r[s] for s, k in zip(on, down)])
        d_y = np.where(down < 0, -1.0, 0.0)
        save = np.array([self.qcost(s, lvl[s]) - self.qcost(s, k) for s, k in zip(on, down)])
        new = m[:, None] - C[:, on] * d_r[None, :] + Y[:, on] * d_y[None, :]
        ok = np.max(new, axis=0) <= self.lim
        off_save = np.array([self.qcost(s, lvl[s]) for s in on])
        off_new = m[:, None] + C[:, on] * r[on][None, :] - Y[:, on]
        off_ok = np.max(off_new, axis=0) <= self.lim
        best_s, best_val, best_k = -1, 1e-12, 0
        for i, s in enumerate(on):
            if ok[i] and save[i] > best_val:
                best_s, best_val, best_k = s, save[i], down[i]
            if off_ok[i] and off_save[i] > best_val:
                best_s, best_val, best_k = s, off_save[i], -1
        if best_s < 0:
            return False, save
        s = best_s
        nr, ny = self.ratio(s, best_k), (1.0 if best_k >= 0 else 0.0)
        self.m = m - C[:, s] * (nr - r[s]) + Y[:, s] * (ny - self.y[s])
        r[s], self.y[s], lvl[s] = nr, ny, best_k
        return True, save

    def pair(self, on: np.ndarray, save: np.ndarray) -> bool:
        """The best pair move (``s`` one to three levels down, a checkpointed ``t`` up by as many levels as that
        needs), taken when it saves and fits exactly; whether it was."""
        best = (1e-9, -1, -1, -1, -1)  # gain, s, s level, t, t level
        for s_ in on[np.argsort(-save)]:
            for k in range(self.lvl[s_] - 1, max(-1, self.lvl[s_] - 4), -1):
                best = self._best_partner(on, int(s_), k, best)
        if best[1] < 0:
            return False
        _, s_, k, t, kt = best
        moves = ((s_, k), (t, kt))
        m2 = self.m - sum(self.C[:, u] * (self.ratio(u, kk) - self.r[u]) for u, kk in moves)
        if not np.max(m2) <= self.lim:  # exact re-check of the pair
            return False
        self.m = m2
        for u, kk in moves:
            self.r[u], self.lvl[u] = self.ratio(u, kk), kk
        return True

    def _best_partner(self, on: np.ndarray, s_: int, k: int, best: tuple) -> tuple:
        """``best`` (gain, s, s level, t, t level), or a better pair moving ``s_`` to level ``k``."""
        C, m, r, lvl = self.C, self.m, self.r, self.lvl
        gain_s = self.qcost(s_, lvl[s_]) - self.qcost(s_, k)
        if gain_s <= best[0]:
            return best
        excess = m - C[:, s_] * (self.ratio(s_, k) - r[s_]) - self.lim
        bind = np.nonzero(excess > 0)[0]
        if not len(bind):
            return best  # a single move, taken above when it saved most
        ts = on[on != s_]
        cb = C[np.ix_(bind, ts)]
        with np.errstate(divide="ignore", invalid="ignore"):
            need = np.where(cb > 0, excess[bind][:, None] / cb, np.inf).max(axis=0)  # Δr per t
        for t, dr in zip(ts, need):
            if not np.isfinite(dr):
                continue
            kt = int(np.searchsorted(self.ratios_of[t], r[t] + dr - 1e-12))
            if kt >= len(self.ratios_of[t]):
                continue
            gain = gain_s - (self.qcost(t, kt) - self.qcost(t, lvl[t]))
            if gain > best[0]:
                best = (gain, int(s_), k, int(t), kt)
        return best
