r"""An integer lower bound for the chain DP: the knapsack at the most binding event alone.

The chain DP's Lagrangian bound at the most binding event ``e*`` (:mod:`sacplan.solver.chain_dp`) is the LP
relaxation of "discard ``need[e*]`` bytes there at least cost"; where each checkpoint has a fixed cost (Gemma-2-2B:
>= 5.8 ms per decoder layer) it sits a block below every plan (134.7 against 137.8 ms) and prunes nothing. This
module solves the same one-event problem in integers:

* per small subtree ``s`` (at most :data:`SMALL` candidates) the exact Pareto set of (bytes ``b`` ↑, cost ms ↓)
  of its decisions: its own levels, or the sum of its children's sets (nothing checkpointed: ``(0, 0)``), each
  level's contribution at ``e*`` raised to 0 when negative and capped at ``need[e*]`` (either only helps);
* for a run of subtrees, and for a larger subtree (its own levels, or its children's run), the dense array
  ``D[x]`` = least cost to reach ``x·w`` bytes, on a grid of ``w = need[e*] / UNITS`` bytes.

A lower bound: ``D`` of one set is exact at every grid point; adding a set to ``D`` shifts each of its points by
``ceil(b/w)`` units (the rest then needs at most ``x - ceil(b/w)`` of them), a larger subtree enters as the points
``((x+1)·w, D[x])`` of its own array (a plan counted at ``x`` may reach nearly ``(x+1)·w``), and a look-up of ``y``
bytes reads ``D[floor(y/w)]`` (less needed, never more): so every ``D[x]`` is at most the cost of any plan reaching
``x·w``. Rounding loses less than ``w`` per set added (:data:`UNITS` 65536: ~1 MB, ~0.002 ms per Gemma layer; a set
of more than :data:`MAX_STEPS` points added to a non-empty array is first rounded up to ``need / MAX_STEPS``);
identical subtrees share one set (a key of their levels and children), and every sum is counted as work.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from sacplan.solver import tree_dp

#: grid points up to ``need[e*]`` (the grid step ``w`` is ``need[e*] / units`` bytes): the fine grid, and the
#: coarse one tried first (16 times cheaper: the fine one only where it beats the Lagrangian bound)
UNITS = 65536
COARSE_UNITS = 4096
#: subtrees of at most this many candidates get an exact Pareto set; larger ones a dense array
SMALL = 32
#: points of a set added to a (non-empty) array above which its bytes are rounded up to ``need / MAX_STEPS`` first
#: (a large subtree's staircase: each point costs a pass over the array)
MAX_STEPS = 1024
#: pairs formed at once when two sets are summed (memory)
CHUNK = 4_000_000

#: (bytes ascending, cost ms ascending): a subtree's Pareto set at ``e*``
Sparse = tuple[np.ndarray, np.ndarray]


class EventKnapsack:
    """The integer one-event bound over a candidate forest: ``children[s]`` per slot, ``levels[s] = (cost ms,
    contribution at e* bytes)`` per option level, ``need`` bytes at ``e*``, on a grid of ``units`` points;
    ``spend(n)`` charges work."""

    def __init__(self, children: list[list[int]], levels: list[tuple[np.ndarray, np.ndarray]], need: float,
                 spend: Callable[[int], None], units: int = UNITS) -> None:
        self.children, self.levels, self.spend, self.units = children, levels, spend, units
        self.need = max(float(need), 1.0)
        self.w = self.need / units
        self.size = [1] * len(children)  # candidates per subtree (pre-order slots: children after parents)
        for s in reversed(range(len(children))):
            self.size[s] += sum(self.size[c] for c in children[s])
        self.keys: dict[int, int] = {}
        self.key_ids: dict[tuple, int] = {}
        self.memo: dict[int, Sparse] = {}
        self.zero = np.full(self.units + 1, math.inf)
        self.zero[0] = 0.0
        self.zero.flags.writeable = False

    def needed(self, byts: np.ndarray | float) -> np.ndarray:
        """The index of the dense arrays to read for ``byts`` bytes still needed: ``floor(byts / w)`` in
        ``[0, units]``."""
        return np.clip(np.floor(np.asarray(byts, dtype=float) / self.w), 0, self.units).astype(np.int64)

    def key(self, s: int) -> int:
        """Equal ids: subtrees with equal levels and equal children (their sets are equal)."""
        if s not in self.keys:
            q, v = self.levels[s]
            k = (q.tobytes(), v.tobytes(), tuple(sorted(self.key(c) for c in self.children[s])))
            self.keys[s] = self.key_ids.setdefault(k, len(self.key_ids))
        return self.keys[s]

    def sparse(self, s: int) -> Sparse:
        """Subtree ``s``'s Pareto set (memoised by :meth:`key`): exact for a small subtree, else the staircase of
        its dense array."""
        k = self.key(s)
        if k not in self.memo:
            q, v = self.levels[s]
            own: Sparse = (np.clip(v, 0.0, self.need), q)
            if self.size[s] <= SMALL:
                acc: Sparse = (np.zeros(1), np.zeros(1))
                for c in self.children[s]:
                    acc = self.add_sparse(acc, self.sparse(c))
                self.memo[k] = pareto(np.concatenate([own[0], acc[0]]), np.concatenate([own[1], acc[1]]))
            else:
                d = self.nothing()
                for c in self.children[s]:
                    d = self.add(d, self.sparse(c))
                d = np.minimum(d, self.add(self.nothing(), own))
                # the staircase's steps: D[x] reaches x·w, maybe up to (x + 1)·w (rounded up: still a lower bound)
                x = np.nonzero(np.isfinite(d) & np.append(d[1:] > d[:-1], True))[0]
                self.memo[k] = (np.minimum((x + 1) * self.w, self.need), d[x])
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
        return pareto(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))

    def nothing(self) -> np.ndarray:
        """The dense array of no subtree: 0 ms for 0 units, nothing more reachable (one read-only array: adding a
        set to it is exact, :meth:`add`)."""
        return self.zero

    def add(self, d: np.ndarray, sp: Sparse) -> np.ndarray:
        """``d`` (dense) plus a subtree's set: ``min over points (b, c) of c + d[max(x - ceil(b/w), 0)]`` per
        ``x`` (added to :meth:`nothing` itself: exact, ``min c over b >= x·w``; an array of real subtrees that
        looks alike still has bytes below one unit, which the rounded-up shift accounts for)."""
        if d is self.zero:
            out = np.full(self.units + 1, math.inf)
            np.minimum.at(out, np.minimum(np.floor(sp[0] / self.w + 1e-9), self.units).astype(np.int64), sp[1])
            self.spend(len(sp[0]) + self.units)
            return np.minimum.accumulate(out[::-1])[::-1]
        if len(sp[0]) > MAX_STEPS:  # rounded up to a coarser grid: still a lower bound
            step = self.need / MAX_STEPS
            sp = pareto(np.minimum(np.ceil(sp[0] / step) * step, self.need), sp[1])
        shift = np.minimum(np.ceil(sp[0] / self.w - 1e-9), self.units).astype(np.int64)  # (rounding: optimistic)
        first = np.ones(len(shift), dtype=bool)  # the cheapest point per shift (costs ascend with bytes)
        first[1:] = shift[1:] != shift[:-1]
        self.spend(int(first.sum()) * self.units // 16)  # slices: ~16 per unit of the DP's time
        out = d.copy()
        for u, c in zip(shift[first].tolist(), sp[1][first].tolist()):
            if u == 0:
                np.minimum(out, d + c, out=out)
                continue
            np.minimum(out[u:], d[:-u] + c, out=out[u:])
            np.minimum(out[:u], c, out=out[:u])  # x <= u: the rest needs nothing (d[0] = 0)
        return out


def pareto(u: np.ndarray, c: np.ndarray) -> Sparse:
    """The points ``(u, c)`` no other beats (``u' >= u`` and ``c' <= c``): bytes ascending, cost ascending
    (:func:`sacplan.solver.tree_dp.pareto` with the bytes as its one coordinate)."""
    keep = tree_dp.pareto(c, u[:, None])
    return u[keep], c[keep]
