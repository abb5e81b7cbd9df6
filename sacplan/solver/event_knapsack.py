r"""An integer lower bound for the chain DP: the knapsack at the most binding event alone.

The chain DP (:mod:`sacplan.solver.chain_dp`) prunes its states by a Lagrangian bound at the most binding event
``e*``: the LP relaxation of "discard ``need[e*]`` bytes there at least cost". Where the blocks are identical and
each checkpoint has a fixed cost (Gemma-2-2B: recomputing any part of a decoder layer costs >= 5.8 ms), that
relaxation sits a whole block below every plan, and nothing is pruned. This module solves the same one-event
problem in integers instead: per subtree ``s`` the exact Pareto set of (bytes ``b`` ↑, cost ms ↓) of its
decisions (its own levels, or the sum of its children's sets; nothing checkpointed: ``(0, 0)``), each level's
contribution at ``e*`` with negative ones raised to 0 and all capped at ``need[e*]`` (either only helps the
subtree); and, for a run of subtrees, the dense array ``D[x]`` = least cost to reach ``x·w`` bytes, on a grid of
``w = need[e*] / UNITS`` bytes.

A lower bound: ``D`` of one set is exact at every grid point; adding a set to ``D`` shifts each of its points by
``ceil(b/w)`` units (the rest then needs at most ``x - ceil(b/w)`` of them), and a look-up of ``y`` bytes reads
``D[floor(y/w)]`` (less needed, never more): so every ``D[x]`` is at most the cost of any plan reaching ``x·w``.
Rounding loses less than ``w`` per set added, identical subtrees share one set (a key of their levels and
children), a set past :data:`MAX_POINTS` is rounded up to the grid (still optimistic), and every pair formed is
counted as work.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

#: grid points up to ``need[e*]`` (the grid step ``w`` is ``need[e*] / UNITS`` bytes)
UNITS = 4096
#: points of one exact set above which it is rounded up to the grid
MAX_POINTS = 4 * UNITS
#: pairs formed at once when a set is summed (memory)
CHUNK = 4_000_000

#: (bytes ascending, cost ms ascending): a subtree's Pareto set at ``e*``
Sparse = tuple[np.ndarray, np.ndarray]


class EventKnapsack:
    """The integer one-event bound over a candidate forest: ``children[s]`` per slot, ``levels[s] = (cost ms,
    contribution at e* bytes)`` per option level, ``need`` bytes at ``e*``; ``spend(units)`` charges work."""

    def __init__(self, children: list[list[int]], levels: list[tuple[np.ndarray, np.ndarray]], need: float,
                 spend: Callable[[int], None]) -> None:
        self.children, self.levels, self.spend = children, levels, spend
        self.need = max(float(need), 1.0)
        self.w = self.need / UNITS
        self.keys: dict[int, int] = {}
        self.key_ids: dict[tuple, int] = {}
        self.memo: dict[int, Sparse] = {}

    def needed(self, byts: np.ndarray | float) -> np.ndarray:
        """The index of :meth:`add`'s arrays to read for ``byts`` bytes still needed: ``floor(byts / w)`` in
        ``[0, UNITS]``."""
        return np.clip(np.floor(np.asarray(byts, dtype=float) / self.w), 0, UNITS).astype(np.int64)

    def key(self, s: int) -> int:
        """Equal ids: subtrees with equal levels and equal children (their sets are equal)."""
        if s not in self.keys:
            q, v = self.levels[s]
            k = (q.tobytes(), v.tobytes(), tuple(sorted(self.key(c) for c in self.children[s])))
            self.keys[s] = self.key_ids.setdefault(k, len(self.key_ids))
        return self.keys[s]

    def sparse(self, s: int) -> Sparse:
        """Subtree ``s``'s Pareto set (memoised by :meth:`key`)."""
        k = self.key(s)
        if k not in self.memo:
            acc: Sparse = (np.zeros(1, np.int64), np.zeros(1))
            for c in self.children[s]:
                acc = self.add_sparse(acc, self.sparse(c))
            q, v = self.levels[s]
            self.memo[k] = self.shrink(pareto(np.concatenate([np.clip(v, 0.0, self.need), acc[0]]),
                                              np.concatenate([q, acc[1]])))
        return self.memo[k]

    def add_sparse(self, a: Sparse, b: Sparse) -> Sparse:
        """The Pareto set of the sums of two subtrees' sets (chunks of :data:`CHUNK` pairs)."""
        parts: list[Sparse] = []
        rows = max(1, CHUNK // max(1, len(b[0])))
        for lo in range(0, len(a[0]), rows):
            au, ac = a[0][lo:lo + rows], a[1][lo:lo + rows]
            self.spend(2 * len(au) * len(b[0]))
            parts.append(pareto(np.minimum(au[:, None] + b[0][None, :], self.need).ravel(),
                                (ac[:, None] + b[1][None, :]).ravel()))
        return self.shrink(pareto(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])))

    def shrink(self, sp: Sparse) -> Sparse:
        """``sp``, rounded up to the grid when it has more than :data:`MAX_POINTS` points."""
        if len(sp[0]) <= MAX_POINTS:
            return sp
        return pareto(np.minimum(np.ceil(sp[0] / self.w) * self.w, self.need), sp[1])

    def nothing(self) -> np.ndarray:
        """The dense array of no subtree: 0 ms for 0 units, nothing more reachable."""
        d = np.full(UNITS + 1, math.inf)
        d[0] = 0.0
        return d

    def add(self, d: np.ndarray, sp: Sparse) -> np.ndarray:
        """``d`` (dense) plus a subtree's set: ``min over points (b, c) of c + d[max(x - ceil(b/w), 0)]`` per
        ``x`` (added to :meth:`nothing`: exact, ``min c over b >= x·w``)."""
        if np.isinf(d[1:]).all():
            out = np.full(UNITS + 1, math.inf)
            np.minimum.at(out, np.minimum(np.floor(sp[0] / self.w + 1e-9), UNITS).astype(np.int64), sp[1])
            self.spend(len(sp[0]) + UNITS)
            return np.minimum.accumulate(out[::-1])[::-1]
        x = np.arange(UNITS + 1)
        out = d.copy()
        rows = max(1, CHUNK // (UNITS + 1))
        units = np.minimum(np.ceil(sp[0] / self.w), UNITS).astype(np.int64)
        for lo in range(0, len(sp[0]), rows):
            u, c = units[lo:lo + rows], sp[1][lo:lo + rows]
            self.spend(2 * len(u) * (UNITS + 1))
            out = np.minimum(out, (c[:, None] + d[np.maximum(x[None, :] - u[:, None], 0)]).min(0))
        return out


def pareto(u: np.ndarray, c: np.ndarray) -> Sparse:
    """The points ``(u, c)`` no other beats (``u' >= u`` and ``c' <= c``): bytes ascending, cost ascending."""
    order = np.lexsort((c, -u))  # units descending, then cheapest first
    u, c = u[order], c[order]
    keep = np.ones(len(c), dtype=bool)
    keep[1:] = c[1:] < np.minimum.accumulate(c)[:-1]
    return u[keep][::-1], c[keep][::-1]
