"""Recompute-vs-memory trade-off of one module call, from its forward ops.

Given a module call's ops (:class:`~sacplan.stats.OpStat`), the activation bytes its forward keeps
(``A``) and where recomputation stops (``recompute_stop``), this module

1. groups ops that must be decided together: an in-place op with the op whose output it modifies, and all
   random ops (recomputing some but not others would replay different random numbers);
2. fixes the groups with no choice: views (free to recompute), groups that modify a tensor from outside
   the module (always saved), groups that cost no bytes to save (always saved) and groups that cost no
   time (always recomputed);
3. gives the remaining groups up in the greedy fill's order from its end (least ms per byte first,
   :func:`~sacplan.opgroups.fill_order`) — each step
   discards more bytes for more recompute time, with non-decreasing ms per byte, so the vertices lie on a
   convex curve;
4. represents the *achievable* cost as a convex piecewise-linear upper bound (a max of lines) in
   normalised units ``r = discarded / max_discard`` and ``q = recompute_ms / full_recompute_ms``.

Why an upper bound: between two greedy vertices no plan exists, so the cost of discarding ``d`` bytes is the
next vertex's (a staircase). The line of greedy segment ``k`` shifted up to pass through
``(r_{k-1}, q_k)`` is above the staircase on that segment; the max of those lines is convex and above the
staircase everywhere, so the MILP stays exact and a plan never costs more than the solver predicted.
When there are more than ``max_lines`` segments, the curve is simplified to the chords between its biggest
bends, each raised just enough to bound the staircase corners in its own range (see :func:`_fit_fewer`).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Iterable, Sequence

from sacplan.opgroups import fill_order, split_groups, stop_index
from sacplan.stats import OpStat, TradeOff

#: Default cap on lines per module before the curve is simplified to chords of its biggest bends.
DEFAULT_MAX_LINES = 8


def recompute_surge(ops: Sequence[OpStat], saved: Iterable[int], recompute_stop: int | None) -> int:
    """Bytes a selective recomputation of one call peaks above a full one's (0 if it does not).

    A full recomputation re-runs ops ``0 .. recompute_stop - 1`` and holds at most what the forward held among
    them. A selective one holds every tensor the plan saved (``saved``: op indices) from its start, where the
    forward held each only from the op that made it: while op ``t`` re-runs, the forward's live bytes plus the
    saved bytes made after ``t``. With ``b_t`` = :attr:`~sacplan.stats.OpStat.below_peak_bytes` and ``K_t`` the
    saved bytes after ``t``: ``max(0, max_t (K_t - b_t) - max_t (-b_t))`` over ``t < recompute_stop``.
    0 for a full checkpoint (nothing saved), for a stop at 0 (nothing re-run) and when the ops carry no live
    figures; ``recompute_stop`` None: no early stop (:func:`~sacplan.opgroups.stop_index`).
    """
    keep = set(saved)
    stop = max(0, min(stop_index(ops, recompute_stop), len(ops)))
    if not keep or stop == 0 or any(o.below_peak_bytes is None for o in ops[:stop]):
        return 0
    after = sum(o.save_cost_bytes for o in ops[stop:] if o.index in keep)  # held from the start too
    with_saved = -math.inf
    for o in reversed(ops[:stop]):
        with_saved = max(with_saved, after - int(o.below_peak_bytes or 0))
        if o.index in keep:
            after += o.save_cost_bytes
    full = -min(int(o.below_peak_bytes or 0) for o in ops[:stop])
    return max(0, int(with_saved - full))


def greedy_vertices(
    ops: Sequence[OpStat], act_bytes: int, recompute_stop: int | None
) -> tuple[list[tuple[int, float, int]], int]:
    """Greedy plans of one module call: the free groups (:func:`~sacplan.opgroups.split_groups`) given up one at a
    time from the end of the greedy fill's order (:func:`~sacplan.opgroups.fill_order`: least ms per byte first).

    Returns:
        ``(vertices, mandatory_bytes)`` where each vertex is ``(discard_bytes, recompute_ms, recompute_flops)``
        in greedy order (first: every choosable group saved; last: only mandatory groups saved), and
        ``mandatory_bytes`` is what must be saved whatever the plan.
    """
    always, free, never = split_groups(ops, False, recompute_stop)
    mandatory = sum(g.bytes for g in always)  # saved in every plan (in-place on an outside tensor; saving is free)
    ms, fl = 0.0, 0
    for g in never:  # recomputed in every plan: views (and what is tied to them), groups that save no time
        ms += g.ms  # (added in turn, as the vertices below are: sum() compensates on Python >= 3.12)
        fl += g.flops
    kept = mandatory + sum(g.bytes for g in free)
    vertices = [(act_bytes - kept, ms, fl)]
    for i in reversed(fill_order(free)):
        kept -= free[i].bytes
        ms += free[i].ms
        fl += free[i].flops
        vertices.append((act_bytes - kept, ms, fl))
    return vertices, mandatory


def build_tradeoff(
    ops: Sequence[OpStat], act_bytes: int, recompute_stop: int | None, max_lines: int = DEFAULT_MAX_LINES
) -> TradeOff | None:
    """The :class:`TradeOff` of one module call, or ``None`` when checkpointing it cannot free anything."""
    if act_bytes <= 0 or not ops:
        return None
    vertices, mandatory = greedy_vertices(ops, act_bytes, recompute_stop)
    max_discard = act_bytes - mandatory
    if max_discard <= 0 or vertices[-1][0] <= 0:
        return None
    max_discard = vertices[-1][0]
    full_ms = vertices[-1][1]
    full_flops = vertices[-1][2]
    # First vertex that discards anything >= 0 (earlier ones keep more than the no-checkpoint step does).
    first = next(i for i, v in enumerate(vertices) if v[0] >= 0)
    pts = [(v[0] / max_discard, (v[1] / full_ms) if full_ms > 0 else 0.0) for v in vertices[first:]]
    if pts[0][0] > 0:
        pts.insert(0, (0.0, pts[0][1]))
    slopes, intercepts = _upper_lines(tuple(pts), max_lines)
    return TradeOff(
        max_discard_bytes=int(max_discard),
        full_recompute_ms=float(full_ms),
        points=tuple(pts),
        slopes=slopes,
        intercepts=intercepts,
        full_recompute_flops=int(full_flops),
    )


def staircase_corners(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The left corners ``(r_{k-1}, q_k)`` of the achievable staircase (plus the first point)."""
    corners = [points[0]]
    for (r0, _), (_, q1) in zip(points, points[1:]):
        corners.append((r0, q1))
    return corners


def staircase(points: Sequence[tuple[float, float]], r: float) -> float:
    """Achievable recompute fraction at discard fraction ``r``: the first vertex with ``r_k >= r``."""
    for rk, qk in points:
        if rk >= r - 1e-12:
            return qk
    return float("inf")


def segment_lines(points: Sequence[tuple[float, float]], corner: bool = False) -> tuple[list[float], list[float]]:
    """Slope and intercept of the line of each segment of ``points`` (those wider than 1e-15 in ``r``): its chord, or
    with ``corner`` the chord raised to pass through the staircase corner ``(r_{k-1}, q_k)``."""
    slopes, intercepts = [], []
    for (r0, q0), (r1, q1) in zip(points, points[1:]):
        if r1 - r0 <= 1e-15:
            continue
        s = (q1 - q0) / (r1 - r0)
        slopes.append(s)
        intercepts.append((q1 if corner else q0) - s * r0)
    return slopes, intercepts


@lru_cache(maxsize=4096)
def _upper_lines(points: tuple[tuple[float, float], ...], max_lines: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    slopes, intercepts = segment_lines(points, corner=True)
    slopes, intercepts = [0.0] + slopes, [points[0][1]] + intercepts
    if len(slopes) > max_lines:
        slopes, intercepts = _fit_fewer(points, max_lines)
    return tuple(float(s) for s in slopes), tuple(float(b) for b in intercepts)


def _fit_fewer(points: Sequence[tuple[float, float]], n_lines: int) -> tuple[list[float], list[float]]:
    """At most ``n_lines`` lines whose max is convex and bounds the achievable staircase everywhere.

    The greedy vertices lie on a convex polyline. Keeping the ``n_lines - 1`` interior vertices where the
    slope grows most (where the curve bends) gives a coarser polyline whose chords have increasing slopes;
    each chord, extended, stays below the convex curve outside its own range. Each chord is then raised
    just enough to lie above the staircase corners inside its range (a per-segment lift). A least-squares
    fit (``pwlf``) was used here before, but its segments are not convex and its lines, extended outside
    their ranges, could dominate the max (q(0) of 299 was seen on a Llama block): chords are exact and fast.
    """
    corners = staircase_corners(points)
    n_seg = max(1, n_lines)
    bends = []
    for i in range(1, len(points) - 1):
        (r0, q0), (r1, q1), (r2, q2) = points[i - 1], points[i], points[i + 1]
        s_in = (q1 - q0) / (r1 - r0) if r1 > r0 else 0.0
        s_out = (q2 - q1) / (r2 - r1) if r2 > r1 else 0.0
        bends.append((s_out - s_in, -i, i))
    bends.sort(reverse=True)
    keep = sorted({0, len(points) - 1, *(b[2] for b in bends[: n_seg - 1])})
    slopes: list[float] = []
    intercepts: list[float] = []
    for a, b in zip(keep, keep[1:]):
        (ra, qa), (rb, qb) = points[a], points[b]
        if rb - ra <= 1e-15:
            continue
        s = (qb - qa) / (rb - ra)
        c = qa - s * ra
        inside = [(cx, cy) for cx, cy in corners if ra <= cx < rb or (b == keep[-1] and cx == rb)]
        lift = max((cy - (s * cx + c) for cx, cy in inside), default=0.0)
        slopes.append(s)
        intercepts.append(c + max(0.0, lift) + 1e-12)
    if not slopes:
        return [0.0], [points[-1][1]]
    return slopes, intercepts
