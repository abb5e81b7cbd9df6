"""The exact Pareto front of one module's save lists (:func:`pareto_front`: the knapsack of
:mod:`sacplan.solver.knapsack` at every capacity at once), its thinning (:func:`thin_front`) and lower hull."""

from __future__ import annotations

import heapq
import math
from typing import Sequence

import numpy as np

from sacplan.opgroups import OpGroup, split_groups, stop_index
from sacplan.stats import OpStat

#: Pareto points the exact front may hold before it is thinned (see :func:`pareto_front`)
FRONT_CAP = 20000
#: vectorised rounds :func:`_strictly_better` tries on near-ties before the plain scan
SCAN_ROUNDS = 16


def pareto_front(
    ops: Sequence[OpStat], *, recompute_stop: int | None = None, cap: int = FRONT_CAP
) -> tuple[list[tuple[int, float, int]], list[OpGroup], set[int], bool]:
    """Every Pareto-optimal choice of free op groups to save (fewest bytes for the most ms saved):
    ``(front, free groups, positions always saved, complete)``, ``front`` of ``(bytes, ms, mask)`` by increasing
    bytes and ms (``mask``: the bit set of chosen free groups), by :func:`front_of_groups` (a Llama-7B block: 44
    free groups, a 438-point front, 2 ms)."""
    ops = tuple(ops)
    stop = stop_index(ops, recompute_stop)
    saved_groups, free, _ = split_groups(ops, False, stop)
    front, complete = front_of_groups(free, cap)
    return front, free, {p for g in saved_groups for p in g.members}, complete


def front_of_groups(free: Sequence[OpGroup], cap: int) -> tuple[list[tuple[int, float, int]], bool]:
    """The DP of :func:`pareto_front`: ``(front, complete)``. Per group, the front so far and its copy with the
    group saved are merged (by bytes, then most ms saved; stable) and only points saving strictly more ms than every
    cheaper one stay (relative tolerance 1e-12); above ``cap`` points, each of ``cap`` equal byte buckets keeps its
    best (``complete`` False). Back-pointers per group, masks rebuilt at the end."""
    B = np.zeros(1, dtype=np.int64)
    M = np.zeros(1, dtype=float)
    complete = True
    steps: list[tuple[np.ndarray, np.ndarray]] = []  # per group: (index into the previous front, group taken)
    for g in free:
        nb = np.concatenate([B, B + int(g.bytes)])
        nm = np.concatenate([M, M + float(g.ms)])
        src = np.concatenate([np.arange(len(B)), np.arange(len(B))])
        took = np.concatenate([np.zeros(len(B), dtype=bool), np.ones(len(B), dtype=bool)])
        order = _merge_order(B, M, nb[len(B):], nm[len(B):])  # by bytes, then most ms; stable
        nb, nm, src, took = nb[order], nm[order], src[order], took[order]
        keep = _strictly_better(nm)
        nb, nm, src, took = nb[keep], nm[keep], src[keep], took[keep]
        if len(nb) > cap:
            complete = False
            width = nb[-1] / cap
            key = np.floor_divide(nb, width).astype(np.int64) if width > 0 else np.zeros(len(nb), dtype=np.int64)
            last = np.ones(len(nb), dtype=bool)
            last[:-1] = key[1:] != key[:-1]  # ms rises along the front: a bucket's best is its last point
            nb, nm, src, took = nb[last], nm[last], src[last], took[last]
        steps.append((src, took))
        B, M = nb, nm
    taken = np.zeros((len(B), len(steps)), dtype=bool)  # [point, group]: the group is saved
    idx = np.arange(len(B))
    for i in range(len(steps) - 1, -1, -1):
        src, took = steps[i]
        taken[:, i] = took[idx]
        idx = src[idx]
    bits = np.packbits(taken, axis=1, bitorder="little")  # group i -> bit i
    masks = [int.from_bytes(row.tobytes(), "little") for row in bits]
    return [(int(b), float(m), k) for b, m, k in zip(B.tolist(), M.tolist(), masks)], complete


def _merge_order(b: np.ndarray, m: np.ndarray, b2: np.ndarray, m2: np.ndarray) -> np.ndarray:
    """``np.lexsort((-ms, bytes))`` of the front ``(b, m)`` followed by its copy ``(b2, m2)`` (``b + g.bytes``),
    by merging: both strictly increasing in bytes (a front), so a copy's point goes after the points of fewer
    bytes and after an equal-bytes one saving at least as much (that one comes first, by index)."""
    n = len(b)
    at = np.searchsorted(b, b2, side="left")
    hit = np.minimum(at, n - 1)
    at += (at < n) & (b[hit] == b2) & (m[hit] >= m2)
    pos = at + np.arange(n)  # the copy's positions in the merged order
    order = np.empty(2 * n, dtype=np.int64)
    mine = np.ones(2 * n, dtype=bool)
    mine[pos] = False
    order[pos] = np.arange(n, 2 * n)
    order[mine] = np.arange(n)
    return order


def _strictly_better(m: np.ndarray) -> np.ndarray:
    """Which points of ``m`` (ms saved, in front order) save strictly more than the last one kept before them
    (relative tolerance 1e-12; the first is kept). Vectorised against the running maximum of *all* points, and
    re-done as the plain scan where a dropped point rose above the last kept one (a near-tie within the
    tolerance), so the answer is always the scan's."""
    run = np.maximum.accumulate(m)
    prev = np.concatenate([[-np.inf], run[:-1]])
    with np.errstate(invalid="ignore"):
        keep = m > prev + 1e-12 * np.maximum(1.0, np.abs(prev))
    keep[0] = True
    if np.array_equal(np.maximum.accumulate(np.where(keep, m, -np.inf)), run):
        return keep
    # the scan's answer is the one fixed point of "kept iff above the last kept before it" (each point's answer
    # depends on the earlier ones only): iterate from the guess, each round settles at least the first wrong one
    for _ in range(SCAN_ROUNDS):
        last = np.concatenate([[-np.inf], np.maximum.accumulate(np.where(keep, m, -np.inf))[:-1]])
        with np.errstate(invalid="ignore"):
            again = m > last + 1e-12 * np.maximum(1.0, np.abs(last))
        again[0] = True
        if np.array_equal(again, keep):
            return keep
        keep = again
    keep = np.zeros(len(m), dtype=bool)
    best = -math.inf
    for i, v in enumerate(m.tolist()):
        if best == -math.inf or v > best + 1e-12 * max(1.0, abs(best)):
            keep[i] = True
            best = v
    return keep


def thin_front(pts: Sequence[tuple[float, float]], keep: int) -> list[int]:
    """Indices of the ``keep`` points of a front (ratio ascending) that :func:`~sacplan.solver.ops.module_options`
    keeps: interior points dropped one at a time, least loss ``(q_next - q_k) · (r_k - r_prev)`` with the *current*
    neighbours first, vertices of the lower convex hull last, ties to the lowest index; the end points stay. A heap
    with lazy deletion over a linked list, O(n log n) (re-scanning at each drop took ~100 s on 19,365 points). Where
    the hull has at least ``keep`` vertices, every other point goes first and each vertex's loss is then taken with
    its hull neighbours: the hull is thinned alone (the same choices)."""
    n = len(pts)
    keep = max(2, int(keep))
    if n <= keep:
        return list(range(n))
    hull = lower_hull_indices(pts)
    if keep <= len(hull) < n:  # every other point goes first, whatever the order: thin the hull alone
        sub = sorted(hull)
        return [sub[i] for i in thin_front([pts[i] for i in sub], keep)]
    prev = list(range(-1, n - 1))
    nxt = list(range(1, n + 1))
    version = [0] * n

    def key(k: int) -> tuple[bool, float, int, int]:
        a, b = prev[k], nxt[k]
        return (k in hull, (pts[b][1] - pts[k][1]) * (pts[k][0] - pts[a][0]), k, version[k])

    heap = [key(k) for k in range(1, n - 1)]
    heapq.heapify(heap)
    alive = n
    dead = [False] * n
    while alive > keep:
        _, _, k, ver = heapq.heappop(heap)
        if dead[k] or ver != version[k]:
            continue
        dead[k] = True
        alive -= 1
        a, b = prev[k], nxt[k]
        nxt[a], prev[b] = b, a
        for j in (a, b):
            if 0 < j < n - 1:
                version[j] += 1
                heapq.heappush(heap, key(j))
    return [k for k in range(n) if not dead[k]]


def lower_hull_indices(pts: Sequence[tuple[float, float]]) -> set[int]:
    """Indices of the lower convex hull's vertices of points sorted by x (Andrew's monotone chain)."""
    hull: list[int] = []
    for i, (x, y) in enumerate(pts):
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = pts[hull[-2]], pts[hull[-1]]
            if (x2 - x1) * (y - y1) - (y2 - y1) * (x - x1) <= 0:
                hull.pop()
            else:
                break
        hull.append(i)
    return set(hull)
