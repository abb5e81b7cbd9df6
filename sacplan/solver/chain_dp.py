r"""Exact DP over sequential blocks, for trees where many events can bind (the trees users bring, issue 26).

The tree DP (:mod:`sacplan.solver.tree_dp`) keeps per subtree the Pareto front of (cost, contribution at every
binding event): hopeless past ~16 binding events, and BERT-large, ViT-L, GPT-2 XL have hundreds. But a checkpointed
candidate ``s`` at level ``k`` contributes ``v_{s,k}[e] = C[e,s]·ρ_k - Y[e,s] - surge`` bytes
(:meth:`~sacplan.solver.problem.SacProblem.linear_terms`), at most events one of two numbers: **held**
(``C[e,s] = A_s``, all its calls' activation bytes, and ``Y[e,s] = o_s``, its overhead: from the end of its
forward to the start of its backward), contributing ``h_{s,k} = A_s·ρ_k - o_s``; **zero** (before its forward
ends, after its backward); else **internal** (its backward, rc events, surge), at few. ``o_s`` is the forward
overhead (``fw_over``): a candidate whose discard autocast's cache partly holds until the forward ends
(:attr:`~sacplan.stats.ModuleStats.cache_held`) keeps less at backward events (``bw_over``), so there it is
neither held nor zero: internal, evaluated exactly (tracked where siblings meet, or the DP gives up). Let ``I_P`` be the events
where subtree ``P``'s candidates are neither all held nor all zero (``A_s = o_s = 0`` counts as both). Outside
``I_P`` a decision of ``P`` contributes one scalar (its held bytes, or 0), so ``P``'s front needs three numbers:
cost ``q`` (ms, ↓), held bytes ``h`` (↑), requirement ``ρ = max_{e ∈ I_P} (need[e] - contribution of P at e)`` (↓):
the decision meets ``I_P`` iff the outside's offset ``O`` there (uniform over ``I_P``, below) is ``>= ρ``.

* ``P`` checkpointed at level ``k``: ``(q_k, h_{P,k}, max_{e∈I_P}(need[e] - v_{P,k}[e]))``.
* ``P`` not checkpointed: its children ``T_1..T_m`` in forward order form a **chain**: at an event of ``I_P`` a
  prefix ``T_1..T_{t-1}`` is held and the rest zero, at an event of ``I_{T_j}`` exactly ``T_1..T_{j-1}``
  (sequential forwards and backwards; where that fails the event is *tracked*, below). The DP sweeps the children
  keeping the Pareto set of states ``(cost ↓, H ↑, R ↓)``, ``H`` the held bytes so far, ``R`` the largest
  requirement so far relative to ``O``: child ``j``'s point ``(q, h, ρ)`` gives ``(cost + q, H + h, max(R, ρ -
  H))``; an event of ``I_P`` with prefix ``t`` and no child inside adds ``max(R, need[e] - H)`` before child ``t``.
  Each update is monotone in the state, so the Pareto filter is exact; the chain's end is ``P``'s point. Inside
  ``I_{T_j}`` the other children are held or zero: a uniform offset, as claimed, by induction from the root.
* **Tracked events**: where siblings overlap (nn.Transformer's post-norm decoder layer, a block called twice) an
  event sees no prefix, or two kids inside. Such events (and the caller's) stay out of ``R``: each state carries
  the kids' exact sum there (one coordinate each, more is better; a kid adds ``h`` where held, 0 where zero, its
  own tracked sum where inside), and at the chain's end ``need[e] - sum`` joins ``R`` or passes up to the caller
  that tracks it. At most :data:`MAX_TRACKED` per chain.
* The root: the chain of the top-level candidates over every binding event, offset 0; the cheapest final state
  with ``R <= tol`` is the optimum.

Pruning, all exact:

* ``R`` above the largest offset the outside can give (its held upper bounds) plus ``tol`` is never met; ``R``
  below the smallest (the held lower bounds) is met by every completion: raised to it. A held sum above ``hcap``
  (the largest need minus every candidate's most negative contribution) meets every event it enters: lowered to it.
* A Lagrangian bound at the most binding event ``e*``, multiplier ``λ >= 0`` (ms per byte, maximised by a
  golden-section search of fixed length): ``λ·need[e*] + Σ_s min(0, min_k q_{s,k} - λ·v_{s,k}[e*], children)``
  bounds every plan's cost. A state whose kids so far are all held at ``e*`` leads to no plan cheaper than
  ``cost - λ·H + λ·need[e*] +`` the Lagrangian minima of all not yet decided; states above a threshold ``U`` go,
  exact when ``U`` is the cost of a plan that fits. The incumbent comes from a first pass keeping a few points
  per front (:meth:`ChainDp.thin`); ``U`` is first tried at small gaps above the bound (:data:`GUESSES`): a pass
  that finds a plan costing at most ``U`` has found the optimum, one that finds none proves it costs more.
* An integer bound (:mod:`~sacplan.solver.event_knapsack`): the same one-event problem in integers on a grid.
  Where blocks carry a fixed cost the Lagrangian bound sits a block below the optimum (Gemma-2-2B: 134.7 against
  137.8 ms) and prunes nothing; the integer one is within the grid's rounding (~0.1 ms). Built where it beats the
  Lagrangian bound on a coarse grid, it bounds the root and each step of the chains near the root (``cost +`` the
  run after the step at ``need[e*] - H``).

Fronts are 3-D (2-D filters on (H, -R) by cost), small whatever the number of binding events. The optimum is
trusted only once re-checked exactly (:func:`~sacplan.solver.tree_dp.exact_check`); work is counted (pairs
formed, points filtered, bound evaluations), never timed (:data:`WORK`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from sacplan.solver.descent import improve
from sacplan.solver.event_knapsack import COARSE_UNITS, UNITS, EventKnapsack
from sacplan.solver.problem import SacProblem
from sacplan.solver.tree_dp import (
    MAX_FRONT, TOL_REL, TreeDpGaveUp, TreeDpResult, WorkMeter, binding_events, candidate_forest, exact_check, levels,
    pareto, run_dp,
)

#: the deterministic work limit (units: coordinates of the pairs formed and the points filtered, grid slices / 16):
#: 1.5 times the user trees' largest proof (29-204 million units, benchmarks/RESULTS.md "Issue 26.2"; Gemma-2-2B
#: 3.4 s at load 8 on the 2-core host), leaving the MILP most of a 60 s call
WORK = 300_000_000
#: relative gaps above the bound tried in turn as the pruning threshold (each pass exact)
GUESSES = (0.002, 0.01, 0.04, 0.16, 0.64)
#: tried before them where the bound is the fine integer one (within ~0.1% of the optimum on the user trees)
FINE_GUESSES = (0.0005, 0.001)
#: golden-section steps for the Lagrangian multiplier (each shrinks the interval by 0.618)
GOLDEN_STEPS = 60
#: chains of at most this many kids pass each kid the integer bound of what lies outside it
OUTSIDE_KIDS = 4
#: events where sibling subtrees overlap that one chain may track exactly (each one more coordinate per state)
MAX_TRACKED = 16
#: points of each front's (held, requirement) staircase the incumbent pass keeps besides its cheap ones
#: (:meth:`ChainDp.thin`; near the least feasible budget the cheap ones alone may lead to no plan at all)
THIN_STAIR = 8
#: state × point pairs formed at once (memory of one chunk: a few arrays of this length)
CHUNK_PAIRS = 1_000_000

#: (slot, level) pairs checkpointed by one point of a front
Recover = Callable[[int], list[tuple[int, int]]]


@dataclasses.dataclass(frozen=True)
class Front3:
    """Pareto points of one subtree: recompute ``cost`` (ms), ``held`` bytes outside its internal events,
    requirement ``req`` (bytes the outside must add there), ``ex`` its exact contributions (bytes) at the events its
    caller tracks (points × events); ``recover(i)`` lists what point ``i`` checkpoints."""

    cost: np.ndarray
    held: np.ndarray
    req: np.ndarray
    ex: np.ndarray
    recover: Recover


class ChainDp(WorkMeter):
    """One run of the chain DP over ``problem`` at ``budget`` bytes (see the module docstring)."""

    where, limit_name = "chain DP", "chain DP work limit"

    def __init__(self, problem: SacProblem, budget: float, work: int | None = WORK) -> None:
        if not problem.exact:
            raise TreeDpGaveUp("not exact mode")
        super().__init__(work)
        self.P, self.budget = problem, float(budget)
        self.binding = binding_events(problem, budget)
        self.need = problem.ev_base[self.binding] - float(budget)
        C, Y = problem.linear_terms()
        self.C, self.Y = C[self.binding], Y[self.binding]
        n = problem.num_candidates
        self.levels = [levels(problem, c) for c in problem.candidates]
        self.A = np.bincount(problem.fw_slot, weights=problem.fw_amt, minlength=n)[:n]
        self.o = np.bincount(problem.fw_slot, weights=problem.fw_over, minlength=n)[:n]
        #: per slot, where its (first) forward ends in the forward post-order: the chain order of siblings
        self.fw_end = np.full(n, len(problem.fw_slot), dtype=np.int64)
        np.minimum.at(self.fw_end, problem.fw_slot, np.arange(len(problem.fw_slot)))
        self.children, self.top = candidate_forest(problem)
        self.masks()
        scale = float(np.max(np.abs(self.need), initial=0.0) + self.A.sum() + self.o.sum() + np.max(problem.ev_base))
        self.tol = TOL_REL * scale + 1e-9
        # every candidate adds at least -(its largest Y and surge) anywhere (C >= 0): a held sum at or above hcap
        # meets every event whatever the others do, so held bytes are clamped there (exact: module docstring)
        low = np.minimum(0.0, -self.Y.max(0, initial=0.0) - np.array([np.max(lv[2], initial=0.0) for lv in self.levels]))
        self.hcap = max(0.0, float(np.max(self.need, initial=0.0) - low.sum())) + self.tol
        #: the pruning bound (module docstring): the most binding event, its multiplier (ms per byte), each
        #: subtree's Lagrangian cost (ms), the incumbent's cost (ms), and whether this is the incumbent's pass
        self.estar = int(np.argmax(self.need)) if len(self.need) else -1
        self.lam, self.lbest = 0.0, np.zeros(n)
        self.incumbent, self.lb_slack, self.beam = math.inf, 0.0, False
        #: the integer bound at estar (module docstring), dense arrays of what lies outside a subtree and after
        #: each step of a chain (cached: they do not depend on the incumbent)
        self.knap: EventKnapsack | None = None
        self.outside: dict[int, np.ndarray] = {}
        self.suffix: dict[tuple[int, ...], list[np.ndarray]] = {}
        self.nothing: np.ndarray | None = None

    def masks(self) -> None:
        """Per slot, over the binding events: ``held_all`` / ``zero_all`` (every candidate of its subtree held /
        zero there; ``I_P`` is where neither is), and ``hmax``, an upper bound of the subtree's held bytes."""
        n, surge = self.P.num_candidates, self.P.ev_surge[self.binding]
        self.held_all: list[np.ndarray] = [np.zeros(0, bool)] * n
        self.zero_all: list[np.ndarray] = [np.zeros(0, bool)] * n
        self.hmax, self.hmin = np.zeros(n), np.zeros(n)
        for s in reversed(range(n)):  # pre-order slots: children before parents
            plain = surge != s
            zero = plain & (self.C[:, s] == 0) & (self.Y[:, s] == 0)
            free = self.A[s] == 0 and self.o[s] == 0  # held and zero are the same: 0 bytes
            held = zero.copy() if free else plain & (self.C[:, s] == self.A[s]) & (self.Y[:, s] == self.o[s])
            ratio = self.levels[s][0]
            own = float(np.max(self.A[s] * ratio - self.o[s], initial=0.0))
            for c in self.children[s]:
                held &= self.held_all[c]
                zero &= self.zero_all[c]
            self.held_all[s], self.zero_all[s] = held, zero
            self.hmax[s] = max(own, float(sum(self.hmax[c] for c in self.children[s])), 0.0)
            low = float(np.min(self.A[s] * ratio - self.o[s], initial=0.0))
            self.hmin[s] = min(low, float(sum(self.hmin[c] for c in self.children[s])), 0.0)

    def internal(self, s: int) -> np.ndarray:
        """``I_s``: the binding events (indices) where ``s``'s subtree is neither all held nor all zero."""
        return np.nonzero(~(self.held_all[s] | self.zero_all[s]))[0]

    def reduce(
        self, cost: np.ndarray, held: np.ndarray, req: np.ndarray, out: tuple[float, float], ex: np.ndarray,
    ) -> np.ndarray:
        """Indices of the points that can still be met and are not dominated (exact contributions ``ex`` at
        tracked events: more is better), when the outside adds between ``out = (omin, omax)`` bytes: ``req`` below
        ``omin`` is raised to it and ``held`` above :attr:`hcap` lowered to it (in place; both exact, module
        docstring), points with ``req > omax + tol`` dropped."""
        np.maximum(req, out[0], out=req)
        np.minimum(held, self.hcap, out=held)
        ok = np.nonzero(req <= out[1] + self.tol)[0]
        self.spend(3 * len(ok))
        keep = ok[pareto(cost[ok], np.column_stack([held[ok], -req[ok], ex[ok]]), self.spend)]
        if self.beam and len(keep):
            keep = keep[self.thin(cost[keep], held[keep], req[keep])]
        self.sizes.append(len(keep))
        if len(keep) > MAX_FRONT:
            raise TreeDpGaveUp(f"a chain front reached {len(keep)} points (> {MAX_FRONT})")
        return keep

    def node(
        self, s: int, out: tuple[float, float], rest: float, outside: np.ndarray | None, track: np.ndarray,
    ) -> Front3:
        """The front of slot ``s``'s subtree whose outside adds ``out = (omin, omax)`` bytes at its internal events
        but those in ``track`` (tracked by its caller, ascending: their exact contributions go into ``ex``), and
        whose outside costs at least ``rest`` ms in the Lagrangian (:meth:`lagrangian`) and ``outside`` in the
        integer bound at estar (dense, :mod:`~sacplan.solver.event_knapsack`; None: unknown)."""
        events = self.internal(s)
        ratio, q, surge = self.levels[s]
        v = self.C[events, s][None, :] * ratio[:, None] - self.Y[events, s][None, :]
        v -= (self.P.ev_surge[self.binding[events]] == s)[None, :] * surge[:, None]
        tracked = np.isin(events, track)
        own_req = np.max(self.need[events[~tracked]][None, :] - v[:, ~tracked], axis=1, initial=-math.inf)
        own_held = self.A[s] * ratio - self.o[s]
        kids = self.chain(self.children[s], events, out, rest, outside, track)
        cost = np.concatenate([q, kids.cost])
        held = np.concatenate([own_held, kids.held])
        req = np.concatenate([own_req, kids.req])
        ex = np.concatenate([v[:, tracked], kids.ex])
        keep = self.reduce(cost, held, req, out, ex)
        nq = len(q)

        def recover(i: int) -> list[tuple[int, int]]:
            j = int(keep[i])
            return [(s, j)] if j < nq else kids.recover(j - nq)

        return Front3(cost[keep], held[keep], req[keep], ex[keep], recover)

    def order(self, kids: list[int], events: np.ndarray) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray]:
        """``kids`` in chain order and, per event of ``events``, the kid internal there (-1: none), the prefix
        of held kids, and whether the event sees them otherwise than as a sequential chain (two kids inside, or
        the held kids not a prefix: such events are tracked exactly, :meth:`chain`)."""
        held = np.array([self.held_all[k][events] for k in kids]).reshape(len(kids), len(events)).T
        zero = np.array([self.zero_all[k][events] for k in kids]).reshape(len(kids), len(events)).T
        self.spend(2 * held.size)
        rank = np.argsort([self.fw_end[k] for k in kids], kind="stable")  # forward order
        kids = [kids[i] for i in rank]
        held, zero = held[:, rank], zero[:, rank]
        inside = ~(held | zero)
        who = np.where(inside.any(1), np.argmax(inside, axis=1), -1)
        # the prefix: the first kid that is not held (a kid both held and zero holds 0 bytes: it fits either way)
        first_not_held = np.where((~held).any(1), np.argmax(~held, axis=1), len(kids))
        prefix = np.where(who >= 0, who, first_not_held)
        pos = np.arange(len(kids))[None, :]
        expect_held = pos < prefix[:, None]
        ok = np.where(expect_held, held, zero) | (pos == who[:, None])
        return kids, who, prefix, ~ok.all(1) | (inside.sum(1) > 1)

    def chain(
        self, kids: list[int], events: np.ndarray, out: tuple[float, float], rest: float,
        outside: np.ndarray | None, track: np.ndarray,
    ) -> Front3:
        """The front of ``kids`` (siblings, their parent not checkpointed) over ``events`` (their parent's ``I``), the
        outside as in :meth:`node`. Events that do not see the kids as a sequential chain, and the caller's ``track``,
        are tracked exactly: each state carries the kids' contributions there (``X``), up to :data:`MAX_TRACKED`."""
        kids, who, prefix, odd = self.order(kids, events) if kids else ([], np.full(len(events), -1),
                                                                         np.zeros(len(events), np.int64),
                                                                         np.zeros(len(events), bool))
        T = np.union1d(track, events[odd])  # tracked here: the caller's, then this chain's own odd events
        if len(T) > MAX_TRACKED:
            raise TreeDpGaveUp(f"not a sequential chain: {len(T)} events see sibling subtrees overlap "
                               f"(> {MAX_TRACKED} tracked)")
        reg = ~np.isin(events, T)
        fneed = np.full(len(kids) + 1, -math.inf)  # per step: the largest need of the regular events no kid is in
        free = reg & (who < 0)
        np.maximum.at(fneed, prefix[free], self.need[events][free])
        cost, held, req, X = np.zeros(1), np.zeros(1), np.full(1, -math.inf), np.zeros((1, len(T)))
        steps: list[tuple[np.ndarray, np.ndarray, Front3]] = []
        lo, hi = out  # bounds of what the outside and the kids so far add at the next kid's events
        best = np.array([self.lbest[k] for k in kids])
        after = rest + (best.sum() - np.cumsum(best))  # Lagrangian cost of the kids after each one, and outside
        modes = self.star_modes(kids)
        slopes = [None if m is None else self.lam if m else 0.0 for m in modes]
        after_k = self.after(kids, outside) if any(m is not None for m in modes) else None
        for j, k in enumerate(kids):
            req = np.maximum(req, fneed[j] - held)
            inside = np.isin(T, self.internal(k))
            front = self.node(k, (lo, hi), rest + best.sum() - best[j], self.kid_outside(kids, j, outside), T[inside])
            lo, hi = lo + self.hmin[k], hi + self.hmax[k]
            ia, ib = self.pairs(held, req, front, out[1], (slopes[j], after[j], cost))
            if after_k is not None and modes[j] is not None and len(ia):  # the integer bound at estar
                ia, ib = self.knap_cut(ia, ib, cost, held if modes[j] else None, front, after_k[j])
            at = np.zeros((len(front.cost), len(T)))  # the kid's contribution at the tracked events
            at[:, inside] = front.ex
            at[:, ~inside & self.held_all[k][T]] = front.held[:, None]
            c2, h2 = cost[ia] + front.cost[ib], held[ia] + front.held[ib]
            r2, X2 = np.maximum(req[ia], front.req[ib] - held[ia]), X[ia] + at[ib]
            keep = self.reduce(c2, h2, r2, out, X2)
            cost, held, req, X = c2[keep], h2[keep], r2[keep], X2[keep]
            steps.append((ia[keep], ib[keep], front))
        req = np.maximum(req, fneed[-1] - held)
        mine = ~np.isin(T, track)  # this chain's own odd events: the outside adds its uniform offset there
        req = np.maximum(req, np.max(self.need[T[mine]][None, :] - X[:, mine], axis=1, initial=-math.inf))
        X = X[:, ~mine]
        last = self.reduce(cost, held, req, out, X)

        def recover(i: int) -> list[tuple[int, int]]:
            out: list[tuple[int, int]] = []
            i = int(last[i])
            for ia, ib, front in reversed(steps):
                out += front.recover(int(ib[i]))
                i = int(ia[i])
            return out

        return Front3(cost[last], held[last], req[last], X[last], recover)

    def pairs(
        self, held: np.ndarray, req: np.ndarray, front: Front3, omax: float, bound: tuple[float | None, float, np.ndarray],
    ) -> tuple[np.ndarray, np.ndarray]:
        """(state, point) index pairs whose combined requirement ``max(req, point.req - held)`` can still be met
        (``<= omax + tol``) and whose Lagrangian bound does not exceed the incumbent: ``bound = (slope, rest,
        cost)``, the pair's bound ``cost + point.cost - slope·(held + point.held) + rest`` (ms; slope None: no
        bound). Formed in chunks of at most :data:`CHUNK_PAIRS`."""
        slope, after, cost = bound
        cut = None if slope is None or not math.isfinite(self.incumbent) else (
            self.incumbent + self.lb_slack - after - self.lam * float(self.need[self.estar]))
        nb = len(front.cost)
        rows = max(1, CHUNK_PAIRS // max(1, nb))
        ia_parts, ib_parts = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        for lo in range(0, len(held), rows):
            hi = min(len(held), lo + rows)
            self.spend(3 * (hi - lo) * nb)
            ok = np.maximum(req[lo:hi, None], front.req[None, :] - held[lo:hi, None]) <= omax + self.tol
            if cut is not None:
                ok &= (cost[lo:hi, None] - slope * held[lo:hi, None]) + (front.cost - slope * front.held)[None, :] <= cut
            a, b = np.nonzero(ok)
            ia_parts.append(a + lo)
            ib_parts.append(b)
        return np.concatenate(ia_parts), np.concatenate(ib_parts)

    def star(self, s: int) -> np.ndarray:
        """Per level of slot ``s``, what it contributes at the most binding event ``estar`` (bytes)."""
        ratio, _, surge = self.levels[s]
        e = self.estar
        return self.C[e, s] * ratio - self.Y[e, s] - (surge if self.P.ev_surge[self.binding[e]] == s else 0.0)

    def lagrangian(self, lam: float) -> tuple[float, np.ndarray]:
        """The Lagrangian bound of the event ``estar`` at multiplier ``lam`` (ms per byte): ``lam·need + Σ_top
        best``, with ``best(s) = min(0, min_k q_k - lam·v_k, Σ_children best)`` per subtree (ms; 0: nothing
        checkpointed). A lower bound of every plan's cost, for every ``lam >= 0``."""
        q, v, start = self.flat
        own = np.minimum.reduceat(np.append(q - lam * v, 0.0), start)[:-1]  # per slot (an empty slot: 0)
        best = np.zeros(self.P.num_candidates)
        for s in reversed(range(self.P.num_candidates)):
            best[s] = min(own[s] if start[s] < start[s + 1] else 0.0, sum(best[c] for c in self.children[s]), 0.0)
        return lam * float(self.need[self.estar]) + float(sum(best[s] for s in self.top)), best

    def multiplier(self) -> float:
        """The multiplier that maximises :meth:`lagrangian` (golden-section search on the concave bound, a fixed
        number of steps: deterministic), into ``lam`` and ``lbest``; returns the bound (ms)."""
        stars = [self.star(s) for s in range(self.P.num_candidates)]
        sizes = [len(v) for v in stars]
        q, v = np.concatenate([lv[1] for lv in self.levels] + [[]]), np.concatenate(stars + [[]])
        #: every level's cost and contribution at estar, flat, and where each slot's start (plus the end)
        self.flat = (q, v, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))
        top = float(np.max(q[v > 0] / v[v > 0], initial=0.0))  # the dearest ms per byte: past it the bound falls
        a, b = 0.0, 2.0 * top + 1e-30
        g = (math.sqrt(5.0) - 1.0) / 2.0
        for _ in range(GOLDEN_STEPS):
            x1, x2 = b - g * (b - a), a + g * (b - a)
            if self.lagrangian(x1)[0] >= self.lagrangian(x2)[0]:
                b = x2
            else:
                a = x1
            self.spend(2 * self.P.num_candidates)
        self.lam = a
        bound, self.lbest = self.lagrangian(a)
        return bound

    def star_modes(self, kids: list[int]) -> list[bool | None]:
        """Per step of the chain ``kids``, what the states' held bytes are at ``estar``: all of it (True: every
        kid so far is held there), nothing (False: every one is zero there), unknown (None) otherwise."""
        out: list[bool | None] = []
        all_held = all_zero = True
        for k in kids:
            all_held &= bool(self.held_all[k][self.estar])
            all_zero &= bool(self.zero_all[k][self.estar])
            out.append(True if all_held else False if all_zero else None)
        return out

    # -- the integer bound at estar (sacplan.solver.event_knapsack) --------------------------------------------
    def after(self, kids: list[int], outside: np.ndarray | None) -> list[np.ndarray] | None:
        """Per step of the chain ``kids`` (in chain order), the dense integer bound of the kids after it and
        the chain's ``outside`` (None: no bound)."""
        if outside is None or self.knap is None:
            return None
        key = (id(outside),) + tuple(kids)
        if key not in self.suffix:
            out = [outside]
            for k in reversed(kids[1:]):
                out.append(self.knap.add(out[-1], self.knap.sparse(k)))
            self.suffix[key] = out[::-1]
        return self.suffix[key]

    def kid_outside(self, kids: list[int], j: int, outside: np.ndarray | None) -> np.ndarray | None:
        """The dense integer bound of what lies outside kid ``j`` of a chain with ``outside`` (the other kids too):
        only while the outside is nothing (near the root, where the bound prunes) and for chains of at most
        :data:`OUTSIDE_KIDS` kids (each costs a sum per kid); else None."""
        if outside is not self.nothing or self.knap is None or len(kids) > OUTSIDE_KIDS:
            return None
        if kids[j] not in self.outside:
            d = outside
            for i, k in enumerate(kids):
                if i != j:
                    d = self.knap.add(d, self.knap.sparse(k))
            self.outside[kids[j]] = d
        return self.outside[kids[j]]

    def knap_bound(self, lagrangian: float) -> float:
        """Builds the integer bound at estar, on the coarse grid and, where that beats the ``lagrangian`` bound
        (ms; the blocks' fixed costs matter), on the fine one; returns its value for the whole forest (ms; a
        lower bound of every plan's cost)."""
        stars = [(lv[1], self.star(s)) for s, lv in enumerate(self.levels)]
        for units in (COARSE_UNITS, UNITS):
            self.knap = EventKnapsack(self.children, stars, float(self.need[self.estar]), self.spend, units)
            self.nothing = d = self.knap.nothing()
            for s in self.top:
                d = self.knap.add(d, self.knap.sparse(s))
            bound = float(d[self.knap.needed(float(self.need[self.estar]) - self.tol)])
            if bound <= lagrangian:
                break
        return bound

    def knap_cut(
        self, ia: np.ndarray, ib: np.ndarray, cost: np.ndarray, held: np.ndarray | None, front: Front3,
        after: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The pairs whose integer bound does not exceed the incumbent: their cost plus ``after`` at the units
        still needed at estar (``held`` None: the kids hold nothing there)."""
        if not math.isfinite(self.incumbent):
            return ia, ib
        self.spend(4 * len(ia))
        have = 0.0 if held is None else held[ia] + front.held[ib]
        left = self.knap.needed(float(self.need[self.estar]) - have - self.tol)
        ok = cost[ia] + front.cost[ib] + after[left] <= self.incumbent + self.lb_slack
        return ia[ok], ib[ok]

    def solve(self) -> tuple[np.ndarray, np.ndarray, float] | None:
        """(y, r, DP cost ms) of the cheapest plan meeting every binding event within ``tol``; None when none does.
        Two passes: a few points per front (:meth:`thin`) for an incumbent (checked exactly), then the exact
        pass, pruned by the incumbent and the Lagrangian bound; where the first guess fails, the incumbent is
        improved (:meth:`improved`) for the later ones."""
        n = self.P.num_candidates
        if not len(self.need):  # every event holds whatever is checkpointed: checkpoint nothing
            return np.zeros(n), np.zeros(n), 0.0
        lagrangian = self.multiplier()
        bound = max(lagrangian, self.knap_bound(lagrangian))
        guesses = (FINE_GUESSES if self.knap is not None and self.knap.units == UNITS else ()) + GUESSES
        self.beam = True
        first = self.best()
        self.beam = False
        known = None if first is None else exact_check(self.P, self.budget, *first)
        first = None if known is None else first
        for i, gap in enumerate(guesses):  # exact at every guess: a plan found within it is the optimum (docstring)
            guess = bound + gap * (abs(bound) + 1e-9)
            self.incumbent = guess if known is None else min(known, guess)
            self.lb_slack = 1e-9 * (1.0 + abs(self.incumbent)) + self.lam * self.tol
            found = self.best()
            if found is not None and found[2] <= self.incumbent + self.lb_slack:  # else pruned: maybe not the best
                return found
            if known is not None and known <= guess:  # every other plan's bound exceeds it: it is the optimum
                return first
            if i == 0 and first is not None:  # the bound is not within the first guess: a better incumbent pays
                first = self.improved(*first)
                known = first[2]
        self.incumbent = math.inf
        return self.best()

    def improved(self, y: np.ndarray, r: np.ndarray, cost: float) -> tuple[np.ndarray, np.ndarray, float]:
        """The incumbent ``(y, r)`` (``cost`` ms, fits) after the local descent over option levels
        (:func:`~sacplan.solver.descent.improve`: a bounded number of moves, deterministic), when that is cheaper
        and fits in exact bytes; else as given."""
        y2, r2 = improve(self.P, y, r, self.budget)
        cost2 = self.P.cost(y2, r2)
        if cost2 < cost and self.P.nesting_ok(y2) and self.P.peak(y2, r2) <= self.budget:
            return y2, r2, cost2
        return y, r, cost

    def thin(self, cost: np.ndarray, held: np.ndarray, req: np.ndarray) -> np.ndarray:
        """The incumbent pass's few points of a front: the most held, the least required, for multipliers around
        ``lam`` the cheapest in ``cost - μ·held`` and in ``cost - μ·(held - req)``, and :data:`THIN_STAIR` points
        spread along the staircase of (held ↑, req ↓) whatever they cost, so that near the least feasible budget,
        where a plan must hold much and require little at once, the pass still finds one (indices, ascending)."""
        pick = {int(np.argmax(held)), int(np.argmin(req))}
        for i in range(-4, 9):
            mu = self.lam * 2.0 ** i
            pick.add(int(np.argmin(cost - mu * held)))
            pick.add(int(np.argmin(cost - mu * (held - req))))
        order = np.lexsort((cost, req, -held))  # most held first; of equal held the least required, the cheapest
        top = np.ones(len(order), dtype=bool)
        top[1:] = req[order[1:]] < np.minimum.accumulate(req[order])[:-1]
        stair = order[top]
        pick.update(stair[np.linspace(0, len(stair) - 1, min(THIN_STAIR, len(stair))).round().astype(np.int64)].tolist())
        return np.array(sorted(pick), dtype=np.int64)

    def best(self) -> tuple[np.ndarray, np.ndarray, float] | None:
        """One pass of the DP (see :meth:`solve`): the cheapest root point meeting every event, or None."""
        n = self.P.num_candidates
        y, r = np.zeros(n), np.zeros(n)
        root = self.chain(self.top, np.arange(len(self.need)), (0.0, 0.0), 0.0, self.nothing, np.zeros(0, np.int64))
        ok = np.nonzero(root.req <= self.tol)[0]
        if not len(ok):
            return None
        i = int(ok[np.argmin(root.cost[ok])])
        for s, k in root.recover(i):
            y[s], r[s] = 1.0, float(self.levels[s][0][k])
        return y, r, float(root.cost[i])


def solve_chain_dp(
    problem: SacProblem, budget: float, work: int | None = WORK, why: list[str] | None = None
) -> TreeDpResult | None:
    """The exact optimum of ``problem`` (exact mode) at ``budget`` bytes by the chain DP, or None when it does not
    apply (not a sequential chain, lines mode) or gives up (more than ``work`` units, :data:`WORK`; None: no
    limit): see :func:`~sacplan.solver.tree_dp.run_dp`."""
    return run_dp(ChainDp, problem, budget, work, why)
