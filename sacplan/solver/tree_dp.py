r"""Exact tree dynamic program for the exact-mode budget problem when few events can bind.

The problem (:class:`~sacplan.solver.problem.SacProblem`, exact mode): choose per candidate ``s`` either "not
checkpointed" or one option level ``k`` (discard ratio ``ρ_{s,k}``, cost ``q_{s,k} = calls·R·frac_k`` ms), with
no checkpointed candidate below another, so that every event fits the budget ``b`` (bytes)::

    ev_base[e] - Σ_s v_{s,k(s)}[e] <= b,      v_{s,k}[e] = C[e,s]·ρ_{s,k} - Y[e,s] - surge_{s,k}·[ev_surge[e] = s]

(:meth:`~sacplan.solver.problem.SacProblem.linear_terms`; ``v`` in bytes, 0 when ``s`` is not checkpointed).
Since ``C >= 0``, an event with ``ev_base + Σ_s max(Y[e,s], 0) + max surge <= b`` holds for every decision; the
others ("binding", ``K`` of them) are the only rows. With ``need[e] = ev_base[e] - b`` the problem is

    min Σ q   s.t.   Σ_s v_s >= need   (K rows),   an antichain of the candidate forest,

a multiple-choice knapsack over a tree. The front of a subtree ``T``, the Pareto set of (cost ↓, contribution
∈ R^K ↑) over its decisions, is {root at level k: (q_k, v_k)} ∪ (⊕ of its children's fronts), ``⊕`` the Minkowski
sum (every pair summed, then pruned); the answer is the cheapest point of the top-level sum meeting ``need``.
Identical sibling subtrees share one front, ``m`` copies summed by doubling (⌈log2 m⌉ + popcount sums).

Exact: no bucketing. Two safe reductions per front of a subtree ``T``, with ``neg_s = min(0, min_k v_{s,k})``
and ``pos_s = max(0, max_k v_{s,k})`` per event, ``N = Σ_all neg``, ``P = Σ_all pos``:

* clamp each coordinate at ``cap_T = need - (N - Σ_{s∈T} neg_s)`` (events with ``need <= N`` hold for every
  decision and are dropped first, so ``cap_T > Σ_T neg``, below any value of ``T``): whatever the other
  candidates choose, they add at least ``N - Σ_T neg``, so a value ``x >= cap_T`` meets ``need`` in every
  completion exactly as ``cap_T`` does; and ``min(x, cap_T) <= x`` makes no completion feasible that was not.
  Clamping commutes with ``⊕``: for ``T = T1 ∪ T2`` (disjoint), a clamped ``cap_T1`` plus any (clamped or not)
  ``x2 >= Σ_T2 neg`` is ``>= need - N + Σ_T1 neg + Σ_T2 neg >= cap_T`` (each ``neg <= 0``; a node's own options
  are counted in ``Σ_T`` though exclusive with its children, which only lowers the cap: still safe), so clamping
  the sum of clamped parts equals clamping the true sum.
* drop points with ``x + (P - Σ_T pos) < need - tol`` on some event: no completion can reach ``need``.

Float sums differ from :meth:`~sacplan.solver.problem.SacProblem.peaks` by far less than ``tol`` (:data:`TOL_REL`
of the largest byte figure: ~0.1 byte at 100 GB), so the DP solves a relaxation (``need - tol``) exactly; its
cheapest point is then checked exactly: feasible means optimal, else the DP gives up rather than trust float sums.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import time
from typing import Any, Callable, Optional

import numpy as np

from sacplan.solver import limits
from sacplan.solver.candidates import Candidate
from sacplan.solver.problem import SacProblem

#: binding events (after dropping those others imply) above which the DP gives up (fronts grow with them)
MAX_BINDING = 16
#: binding events above which the DP gets at most :data:`WIDE_WORK` units: its fronts are then small only on small
#: models (the tiny conformance models: 5-16 events, proofs in ms), so a run that would fail fails early
WIDE = 4
#: The deterministic work limits: units are numbers touched (coordinates of the pairs a Minkowski sum forms,
#: point-pair coordinates a Pareto filter compares, option rows an event screen compares), counted, never timed,
#: so the DP gives up at the same point on every run. Loaded 2-core host: Llama x32 at 90% of its peak (12 binding
#: events) 3.0e8 units in 2.9 s, the tiny Mixtral near its minimum 4e8 in over 10 s; :data:`WIDE_WORK` is about a
#: second of a quiet core.
WORK = 1_000_000_000
WIDE_WORK = 100_000_000
#: events that can exceed the budget above which the DP does not screen them for the binding ones
MAX_SCREENED = 5_000
#: points one front may keep before the DP gives up
MAX_FRONT = 200_000
#: pairs one Minkowski sum may form before the DP gives up (time and memory: summed in chunks)
MAX_PAIRS = 20_000_000
#: pairs summed at once (bounds the memory of one chunk: ~(K+1)·8 bytes each)
CHUNK_PAIRS = 1_000_000
#: points above which :func:`pareto` with two coordinates is first pre-filtered (:func:`prefilter_2d`, blocks of
#: :data:`PREFILTER_BLOCK`): the chain DP's largest sums form millions of pairs of which ~2% stay
PREFILTER_MIN = 8192
PREFILTER_BLOCK = 2048
#: points per block of :func:`pareto_2d`, and those left in a block up to which they are compared pairwise
PARETO_BLOCK = 512
PAIRWISE_MAX = 48
#: float slack of the relaxation, relative to the largest byte figure summed (the exact check decides): sums of
#: n terms err by at most ~n·2.2e-16 of it, below this for n up to thousands of candidates
TOL_REL = 1e-12


@dataclasses.dataclass(frozen=True)
class TreeDpResult:
    """The DP's optimum: flags ``y`` and ratios ``r`` per slot, its exact cost (ms), the binding events, the size
    of each front built (points), the seconds it took and the work units it spent (deterministic)."""

    y: np.ndarray
    r: np.ndarray
    cost_ms: float
    binding: tuple[int, ...]
    front_sizes: tuple[int, ...]
    seconds: float
    work: int = 0


class TreeDpGaveUp(Exception):
    """Why the DP did not apply (``str(e)``): too many binding events, continuous lines, a front too large..."""


def binding_events(problem: SacProblem, budget: float) -> np.ndarray:
    """The events that some decision can push over ``budget`` bytes (ascending): ``ev_base`` plus every positive
    ``Y`` term and the largest surge exceeds it. :class:`TreeDpGaveUp` past :data:`MAX_SCREENED` of them."""
    _, Y = problem.linear_terms()
    binding = np.nonzero(problem.ev_base + np.clip(Y, 0, None).sum(1) + problem.surge_top() > budget)[0]
    if len(binding) > MAX_SCREENED:
        raise TreeDpGaveUp(f"{len(binding)} events can exceed the budget (> {MAX_SCREENED} to screen)")
    return binding


def levels(problem: SacProblem, c: Candidate) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Candidate ``c``'s checkpoint levels: discard ratios, recompute ms over all calls and the surge (bytes) at
    its rc events, per exact option at or above its ``min_ratio`` (the MILP's ``r >= min_ratio·y``); one free
    level of ratio 1 for a module that costs nothing to recompute. :class:`TreeDpGaveUp` for trade-off lines."""
    o = problem.options(c.slot)
    if o is None:
        if c.recompute_ms > 0:
            raise TreeDpGaveUp(f"candidate {c.fqn!r} has no exact options (continuous trade-off lines)")
        return np.array([1.0]), np.array([0.0]), np.zeros(1)
    ok = np.asarray(o.ratio) >= c.min_ratio
    ratio = np.asarray(o.ratio, dtype=float)[ok]
    q = (c.calls * c.recompute_ms * np.asarray(o.frac, dtype=float))[ok]
    surge = np.asarray(problem.surge(c.slot), dtype=float)[ok] if problem.surge(c.slot) else np.zeros(len(ratio))
    return ratio, q, surge


def exact_check(problem: SacProblem, budget: float, y: np.ndarray, r: np.ndarray, dp_cost: float) -> float | None:
    """The exact cost (ms) of a DP's decision ``(y, r)`` when it nests, fits ``budget`` in exact bytes
    (:meth:`~sacplan.solver.problem.SacProblem.peak`) and costs what the DP summed (``dp_cost``); else None."""
    cost = problem.cost(y, r)
    if not problem.nesting_ok(y) or problem.peak(y, r) > budget or abs(cost - dp_cost) > 1e-9 * (1.0 + abs(cost)):
        return None
    return cost


class Front:
    """Pareto points (cost ms, contributions bytes per binding event) of ``roots`` subtrees, with back-pointers:
    ``recover(i, slots)`` lists the (slot, level) checkpointed by point ``i`` when the subtrees are rooted at
    ``slots`` (identical subtrees share a front; pre-order slots are relative to the root)."""

    def __init__(self, cost: np.ndarray, vec: np.ndarray, roots: int, neg: np.ndarray, pos: np.ndarray,
                 recover: Callable[[int, list[int]], list[tuple[int, int]]]) -> None:
        self.cost, self.vec, self.roots, self.neg, self.pos, self.recover = cost, vec, roots, neg, pos, recover


#: charges work units (and raises :class:`TreeDpGaveUp` past the limit); None: not counted
Spend = Optional[Callable[[int], None]]


def pareto(cost: np.ndarray, vec: np.ndarray, spend: Spend = None) -> np.ndarray:
    """Indices of the points not dominated (cost <=, every coordinate >=; of equal points the first), by cost.

    Charges ``spend`` between blocks: with 3 or more coordinates the filter is quadratic in the points kept
    (50,000 in 8 coordinates: ~50 s), so a front too large ends in :class:`TreeDpGaveUp` at the work limit, or past
    :data:`MAX_FRONT` points."""
    n, K = vec.shape
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if K == 2 and n > PREFILTER_MIN:  # most points of a large 2-D sum go before the full sort
        sub = prefilter_2d(cost, vec, spend)
        if sub is not None:
            return sub[pareto_sorted(cost[sub], vec[sub], spend)]
    return pareto_sorted(cost, vec, spend)


def pareto_sorted(cost: np.ndarray, vec: np.ndarray, spend: Spend = None) -> np.ndarray:
    """:func:`pareto` by its full sort (cost, then each coordinate descending, then index)."""
    n, K = vec.shape
    order = np.lexsort(tuple(-vec[:, j] for j in range(K - 1, -1, -1)) + (cost,))
    v = vec[order]
    if K == 1:
        keep = np.ones(n, dtype=bool)
        keep[1:] = v[1:, 0] > np.maximum.accumulate(v[:, 0])[:-1]
        return order[keep]
    if K == 2:
        return order[pareto_2d(v, spend)]
    kept: list[np.ndarray] = []  # K >= 3: a plain filter, block by block against the points kept
    n_kept = 0
    for lo in range(0, n, 256):
        if n_kept > MAX_FRONT:
            raise TreeDpGaveUp(f"a front reached {n_kept} points (> {MAX_FRONT})")
        cv = v[lo:lo + 256]
        if spend is not None:
            spend((n_kept + len(cv)) * len(cv) * K)
        kv = v[np.concatenate(kept)] if kept else np.empty((0, K))
        dom = (kv[:, None, :] >= cv[None, :, :]).all(-1).any(0) if len(kv) else np.zeros(len(cv), dtype=bool)
        inner = (cv[None, :, :] >= cv[:, None, :]).all(-1)  # inner[i, j]: j dominates i
        kept.append(np.nonzero(~(dom | np.tril(inner, -1).any(1)))[0] + lo)
        n_kept += len(kept[-1])
    return order[np.concatenate(kept)]


def prefilter_2d(cost: np.ndarray, vec: np.ndarray, spend: Spend = None) -> np.ndarray | None:
    """A superset of :func:`pareto`'s points for two coordinates, cheaper than its full sort (indices ascending;
    None: not worth it).

    Points in cost order (stable), filtered by :func:`stair_filter`: a point an earlier one weakly dominates goes
    (:func:`pareto` drops it too), and :func:`pareto` of what is left is :func:`pareto` of all (the left points
    keep their relative order, so the full sort breaks ties among them as before). The cheapest tenth (at least
    :data:`PREFILTER_MIN` points) goes first: None where it loses less than half (the full sort is then as cheap)."""
    n = len(cost)
    cut = np.partition(cost, max(PREFILTER_MIN, n // 10) - 1)[max(PREFILTER_MIN, n // 10) - 1]
    stair = np.empty((0, 2))
    left: list[np.ndarray] = []
    for part, trial in ((np.nonzero(cost <= cut)[0], True), (np.nonzero(cost > cut)[0], False)):
        part = part[np.argsort(cost[part], kind="stable")]  # the two parts in turn: the whole stable cost order
        ok, stair = stair_filter(vec[part], PREFILTER_BLOCK, stair, spend)
        left.append(part[ok])
        if trial and 2 * len(ok) > len(part):
            return None
    return np.sort(np.concatenate(left))


def stair_filter(
    v: np.ndarray, block: int, stair: np.ndarray, spend: Spend = None,
    within: Callable[[np.ndarray], np.ndarray] | None = None, extra: Callable[[int], int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Positions of the points ``v`` (in order) that neither ``stair`` nor an earlier block dominates (both
    coordinates >=), block by block against the :func:`staircase` of what came before; ``within(points)``: which of a
    block's points left to keep (None: all; a point the staircase dominates dominates nothing it does not). Charges
    ``spend`` per block the staircase test plus ``extra(points left)``. Returns the positions and the staircase."""
    keep = [np.zeros(0, dtype=np.int64)]
    for lo in range(0, len(v), block):
        cv = v[lo:lo + block]
        left = np.nonzero(~dominated_by(stair, cv))[0]
        if spend is not None:
            spend(2 * (len(cv) + len(stair)) + (0 if extra is None else extra(len(left))))
        ok = left if within is None else left[within(cv[left])]
        keep.append(ok + lo)
        stair = staircase(np.concatenate([stair, cv[ok]]))
    return np.concatenate(keep), stair


def staircase(v: np.ndarray) -> np.ndarray:
    """The 2-D maxima of points ``v`` (n × 2), v0 ascending (so v1 descending)."""
    s = v[np.lexsort((-v[:, 1], -v[:, 0]))]
    top = np.ones(len(s), dtype=bool)
    top[1:] = s[1:, 1] > np.maximum.accumulate(s[:, 1])[:-1]
    return s[top][::-1]


def dominated_by(stair: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Which points ``v`` some point of ``stair`` (from :func:`staircase`) dominates: the first one with
    v0 >= theirs has the largest v1 of those."""
    if not len(stair):
        return np.zeros(len(v), dtype=bool)
    i = np.minimum(np.searchsorted(stair[:, 0], v[:, 0], side="left"), len(stair) - 1)
    return (stair[i, 0] >= v[:, 0]) & (stair[i, 1] >= v[:, 1])


def pareto_2d(v: np.ndarray, spend: Spend = None) -> np.ndarray:
    """:func:`pareto` for two coordinates of points already in order: a point is dominated iff an earlier one
    has both coordinates >= (positions, ascending). :func:`stair_filter` by blocks of :data:`PARETO_BLOCK`, the
    few left in a block against the earlier ones left: pairwise up to :data:`PAIRWISE_MAX`, else by
    :func:`sweep_2d`. Charged besides 8 units per point left, by started runs of 4,096."""
    seen = [0]

    def extra(n: int) -> int:
        before, seen[0] = seen[0], seen[0] + n
        return 4096 * 8 * (-(-seen[0] // 4096) - -(-before // 4096))

    def within(c: np.ndarray) -> np.ndarray:
        if len(c) > PAIRWISE_MAX:
            return sweep_2d(c)
        earlier = (c[None, :, 0] >= c[:, None, 0]) & (c[None, :, 1] >= c[:, None, 1])  # [i, j]: j has both >=
        return np.nonzero(~np.tril(earlier, -1).any(1))[0]

    return stair_filter(v, PARETO_BLOCK, np.empty((0, 2)), spend, within, extra)[0]


def sweep_2d(v: np.ndarray) -> np.ndarray:
    """Positions of the points ``v`` (in order) that no earlier one dominates (both coordinates >=), by one
    sweep keeping the staircase of those kept in lists."""
    xs: list[float] = []  # the kept points' staircase: xs ascending, ys descending
    ys: list[float] = []
    keep = []
    for j, (a, b) in enumerate(zip(v[:, 0].tolist(), v[:, 1].tolist())):
        i = bisect.bisect_left(xs, a)
        if i < len(xs) and ys[i] >= b:
            continue
        keep.append(j)
        k = i  # entries with x <= a and y <= b (a run ending at i, or at i + 1 when xs[i] == a) go
        while k > 0 and ys[k - 1] <= b:
            k -= 1
        hi = i + 1 if i < len(xs) and xs[i] == a else i
        del xs[k:hi], ys[k:hi]
        xs.insert(k, a)
        ys.insert(k, b)
    return np.asarray(keep, dtype=np.int64)


def candidate_forest(problem: SacProblem) -> tuple[list[list[int]], list[int]]:
    """Each candidate's children (slots, pre-order) and the top-level candidates."""
    children: list[list[int]] = [[] for _ in problem.candidates]
    top: list[int] = []
    for c in problem.candidates:
        (top if c.parent_slot < 0 else children[c.parent_slot]).append(c.slot)
    return children, top


class WorkMeter:
    """A DP run's work count: ``work`` units spent of ``work_max`` (None: no limit), the size of every front built
    (points), named ``where`` in what it records."""

    where, limit_name = "tree DP", "work limit"

    def __init__(self, work: int | None) -> None:
        self.work, self.work_max, self.sizes = 0, (math.inf if work is None else work), []

    def spend(self, units: int) -> None:
        """Charge ``units`` of work: :class:`TreeDpGaveUp` past the work limit (deterministic), or when the call's
        wall-clock safety net fires (recorded by :func:`~sacplan.solver.limits.past_deadline`)."""
        self.work += int(units)
        if self.work > self.work_max:
            raise TreeDpGaveUp(f"{self.limit_name} ({self.work_max:,} units)")
        if limits.past_deadline(self.where):
            raise TreeDpGaveUp("wall-clock safety net (time limit)")


class TreeDp(WorkMeter):
    """One run of the DP over ``problem`` at ``budget`` bytes (see the module docstring)."""

    def __init__(self, problem: SacProblem, budget: float, work: int | None = WORK) -> None:
        super().__init__(work)
        self.P = problem
        if not problem.exact:
            raise TreeDpGaveUp("not exact mode")
        C, Y = problem.linear_terms()
        self.binding = binding_events(problem, budget)
        K = len(self.binding)
        self.need = problem.ev_base[self.binding] - float(budget)
        self.opts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # per slot: ratios, costs ms, v (k × K)
        for c in problem.candidates:
            ratio, q, surge = levels(problem, c)
            sg = np.zeros((len(ratio), K))
            sg[:, problem.ev_surge[self.binding] == c.slot] = surge[:, None]
            v = C[self.binding, c.slot][None, :] * ratio[:, None] - Y[self.binding, c.slot][None, :] - sg
            self.opts.append((ratio, q, v))
        self.reduce_events()
        K = len(self.need)
        if K > WIDE:
            self.work_max = min(self.work_max, WIDE_WORK)
        self.neg, self.pos = self.bounds()
        self.N, self.Ptot = np.sum(self.neg, axis=0), np.sum(self.pos, axis=0)
        self.tol = TOL_REL * float(np.max(np.abs(self.need) + self.Ptot - self.N, initial=0.0) + np.max(problem.ev_base)) + 1e-9
        self.children, self.top = candidate_forest(problem)
        self.sig: dict[int, int] = {}
        self.sig_ids: dict[tuple, int] = {}
        self.memo: dict[int, Front] = {}
        self.zero = Front(np.zeros(1), np.zeros((1, K)), 0, np.zeros(K), np.zeros(K), lambda i, slots: [])

    def bounds(self) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per slot, ``neg_s = min(0, min_k v_{s,k})`` and ``pos_s = max(0, max_k v_{s,k})`` per binding event
        (bytes; not checkpointing ``s`` contributes 0)."""
        K = len(self.need)
        neg = [np.minimum(0.0, v.min(0)) if len(v) else np.zeros(K) for _, _, v in self.opts]
        pos = [np.maximum(0.0, v.max(0)) if len(v) else np.zeros(K) for _, _, v in self.opts]
        return neg, pos

    def reduce_events(self) -> None:
        """Keep the binding events no other implies: ``e`` goes when every decision meets it (``need[e] <= Σ_s
        neg_s[e]``), or when a kept ``f`` has ``need[f] >= need[e]`` and every option contributes at ``e`` at least
        what it does at ``f`` (``Σ v[e] >= Σ v[f] >= need[f] >= need[e]``). Events in order of need, so only kept
        ones are compared; more than :data:`MAX_BINDING` kept: give up."""
        V = np.concatenate([v for _, _, v in self.opts])
        low = np.sum(self.bounds()[0], axis=0)
        kept: list[int] = []
        for e in np.argsort(-self.need, kind="stable").tolist():
            self.spend(len(V) * max(1, len(kept)))
            if self.need[e] <= low[e]:  # met by every decision (and the caps below need need > Σ neg)
                continue
            if kept and (V[:, kept] <= V[:, e:e + 1]).all(0).any():
                continue
            kept.append(e)
            if len(kept) > MAX_BINDING:
                raise TreeDpGaveUp(f"more than {MAX_BINDING} of {len(self.need)} events can bind (not implied by others)")
        kept.sort()
        self.binding, self.need = self.binding[kept], self.need[kept]
        self.opts = [(ratio, q, v[:, kept]) for ratio, q, v in self.opts]

    def signature(self, s: int) -> int:
        """Equal ids: subtrees with equal options (bytes at the binding events, costs) and equal children."""
        if s not in self.sig:
            ratio, q, v = self.opts[s]
            key = (ratio.tobytes(), q.tobytes(), v.tobytes(), tuple(sorted(self.signature(c) for c in self.children[s])))
            self.sig[s] = self.sig_ids.setdefault(key, len(self.sig_ids))
        return self.sig[s]

    def ordered(self, slots: list[int]) -> list[int]:
        return sorted(slots, key=lambda s: (self.signature(s), s))

    def reduce(self, cost: np.ndarray, vec: np.ndarray, neg: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Clamp at the cap, drop hopeless points, keep the Pareto set; returns the kept indices (vec clamped in
        place)."""
        np.minimum(vec, self.need - (self.N - neg), out=vec)
        ok = np.nonzero((vec + (self.Ptot - pos) >= self.need - self.tol).all(1))[0]
        return ok[pareto(cost[ok], vec[ok], self.spend)]

    def check(self, n: int) -> None:
        self.sizes.append(n)
        if n > MAX_FRONT:
            raise TreeDpGaveUp(f"a front reached {n} points (> {MAX_FRONT})")
        self.spend(n)

    def add(self, a: Front, b: Front) -> Front:
        """Minkowski sum of two fronts over disjoint subtrees, reduced."""
        if a.roots == 0:
            return b
        neg, pos = a.neg + b.neg, a.pos + b.pos
        # Only pairs that can still meet need on coordinate 0 (b sorted by it: a range of b per point of a); with
        # one coordinate, b's front rises in cost with it, so of the pairs reaching the cap only the first counts.
        ob = np.argsort(b.vec[:, 0], kind="stable")
        bx = b.vec[ob, 0]
        start = np.searchsorted(bx, self.need[0] - (self.Ptot[0] - pos[0]) - self.tol - a.vec[:, 0], side="left")
        end = np.full(len(a.cost), len(bx))
        if len(self.need) == 1:  # + 2: float slack at the cap
            end = np.minimum(end, np.searchsorted(bx, self.need[0] - (self.N[0] - neg[0]) - a.vec[:, 0]) + 2)
        counts = np.maximum(end - start, 0)
        total = int(counts.sum())
        if total > MAX_PAIRS:
            raise TreeDpGaveUp(f"a sum of fronts would form {total} pairs (> {MAX_PAIRS})")
        parts: list[tuple[np.ndarray, ...]] = [(np.zeros(0), np.zeros((0, len(self.need))), np.zeros(0, np.int64),
                                                np.zeros(0, np.int64))]
        csum = np.concatenate([[0], np.cumsum(counts)])
        lo = 0
        while lo < len(counts):  # reduce chunk by chunk (exact: a point dominated in a chunk is dominated)
            hi = max(lo + 1, int(np.searchsorted(csum, csum[lo] + CHUNK_PAIRS, side="right")) - 1)
            self.spend(int(csum[hi] - csum[lo]) * (len(self.need) + 1))
            ia = np.repeat(np.arange(lo, hi), counts[lo:hi])
            ib = ob[start[ia] + np.arange(len(ia)) - (csum[ia] - csum[lo])]
            cost, vec = a.cost[ia] + b.cost[ib], a.vec[ia] + b.vec[ib]
            k = self.reduce(cost, vec, neg, pos)
            parts.append((cost[k], vec[k], ia[k], ib[k]))
            lo = hi
        cost, vec, ia, ib = (np.concatenate(x) for x in zip(*parts))
        if len(parts) > 2:
            k = self.reduce(cost, vec, neg, pos)
            cost, vec, ia, ib = cost[k], vec[k], ia[k], ib[k]
        self.check(len(cost))
        ra = a.roots

        def recover(i: int, slots: list[int]) -> list[tuple[int, int]]:
            return a.recover(int(ia[i]), slots[:ra]) + b.recover(int(ib[i]), slots[ra:])

        return Front(cost, vec, a.roots + b.roots, neg, pos, recover)

    def forest(self, slots: list[int]) -> Front:
        """The front of the subtrees rooted at ``slots`` (ordered by :meth:`ordered`), identical ones by doubling."""
        acc = self.zero
        i = 0
        while i < len(slots):
            j = i
            while j < len(slots) and self.signature(slots[j]) == self.signature(slots[i]):
                j += 1
            base, m, group = self.node(slots[i]), j - i, self.zero
            while m:
                if m & 1:
                    group = self.add(group, base)
                m >>= 1
                if m:
                    base = self.add(base, base)
            acc = self.add(acc, group)
            i = j
        return acc

    def node(self, s: int) -> Front:
        """The front of candidate ``s``'s subtree: its own options ∪ its children's forest."""
        sig = self.signature(s)
        if sig in self.memo:
            return self.memo[sig]
        kids = self.forest(self.ordered(self.children[s]))
        ratio, q, v = self.opts[s]
        neg, pos = kids.neg + self.neg[s], kids.pos + self.pos[s]
        cost = np.concatenate([q, kids.cost])
        vec = np.concatenate([v, kids.vec])
        k = self.reduce(cost, vec, neg, pos)
        cost, vec = cost[k], vec[k]
        self.check(len(cost))
        nq = len(q)

        def recover(i: int, slots: list[int]) -> list[tuple[int, int]]:
            (root,) = slots
            j = int(k[i])
            if j < nq:
                return [(root, j)]
            return kids.recover(j - nq, self.ordered(self.children[root]))

        f = Front(cost, vec, 1, neg, pos, recover)
        self.memo[sig] = f
        return f

    def solve(self) -> tuple[np.ndarray, np.ndarray, float] | None:
        """(y, r, DP cost ms) of the cheapest point meeting ``need - tol``; None when none does."""
        if not len(self.need):  # every event holds whatever is checkpointed: checkpoint nothing
            return np.zeros(self.P.num_candidates), np.zeros(self.P.num_candidates), 0.0
        top = self.ordered(self.top)
        root = self.forest(top)
        ok = np.nonzero((root.vec >= self.need - self.tol).all(1))[0]
        if not len(ok):
            return None
        i = int(ok[np.argmin(root.cost[ok])])
        y, r = np.zeros(self.P.num_candidates), np.zeros(self.P.num_candidates)
        for s, k in root.recover(i, top):
            y[s], r[s] = 1.0, float(self.opts[s][0][k])
        return y, r, float(root.cost[i])


def solve_tree_dp(
    problem: SacProblem, budget: float, work: int | None = WORK, why: list[str] | None = None
) -> TreeDpResult | None:
    """The exact optimum of ``problem`` (exact mode) at ``budget`` bytes by the tree DP, or None when it does not
    apply or gives up (more than ``work`` units, :data:`WORK`; None: no limit but :data:`WIDE_WORK`): see
    :func:`run_dp`."""
    return run_dp(TreeDp, problem, budget, work, why)


def run_dp(
    dp_class: Callable[..., Any], problem: SacProblem, budget: float,
    work: int | None, why: list[str] | None,
) -> TreeDpResult | None:
    """``dp_class(problem, budget, work).solve()`` (the tree or the chain DP) with its point checked exactly
    (:func:`exact_check`): the proven optimum, or None when the DP gave up (work limit, wall-clock safety net, out
    of memory), found no feasible point, or its point failed the check; the reason is appended to ``why``."""
    t0 = time.monotonic()
    try:
        dp = dp_class(problem, budget, work)
        out = dp.solve()
    except TreeDpGaveUp as e:
        reason = str(e)
    except MemoryError:
        reason = "out of memory"
    else:
        reason = "no point meets the budget (infeasible over these options)"
        if out is not None:
            y, r, dp_cost = out
            cost = exact_check(problem, budget, y, r, dp_cost)
            if cost is not None:
                return TreeDpResult(y=y, r=r, cost_ms=cost, binding=tuple(int(e) for e in dp.binding),
                                    front_sizes=tuple(dp.sizes), seconds=time.monotonic() - t0, work=dp.work)
            reason = "the DP's point failed the exact check (within float slack of the budget)"
    if why is not None:
        why.append(reason)
    return None
