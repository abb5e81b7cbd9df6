"""The SAC problem (:class:`SacProblem`): a tree's memory timeline read once into arrays (candidates, running-sum
positions, every event's bytes per rank, exact-mode op-level options), and the exact evaluation of a decision
(flags ``y``, ratios ``r`` per candidate slot) in bytes (:meth:`SacProblem.peaks`) and ms (:meth:`SacProblem.cost`).
Budget-independent."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from sacplan.evaluate import rng_copy_bytes
from sacplan.sacmode import dispatch_ms, full_runs_selective
from sacplan.solver.backends import lp_solver
from sacplan.solver.candidates import Candidate, relaxed_candidate, select_candidates
from sacplan.solver.ops import ModuleOptions, module_options
from sacplan.timeline import BW, RC, Timeline
from sacplan.tradeoff import recompute_surge
from sacplan.tree import ModuleTree, as_tree


class SacProblem:
    """The problem of ``tree`` (or the ModelStats ``collect`` returns) for ``world_size`` ranks (None: as collected),
    ``ac_units`` and ``fsdp_units`` (:func:`~sacplan.solver.candidates.select_candidates`); ``exact``: op-level
    options (at most ``max_options``); ``relax``: lower-bound mode (each cost the LP relaxation of its knapsack)."""

    def __init__(
        self,
        tree: ModuleTree,
        world_size: int | None = None,
        ac_units: Sequence[str] | None = None,
        fsdp_units: Sequence[str] | None = None,
        exact: bool = False,
        max_options: int | None = 16,
        solver: str = "auto",
        relax: bool = False,
    ) -> None:
        tree = as_tree(tree)
        #: the step's memory timeline for ``world_size`` ranks: sacplan's one memory model (:mod:`sacplan.timeline`)
        timeline = Timeline.of(tree.stats, world_size)
        #: candidates in pre-order (slot = index), and warnings about named ``ac_units`` that cannot be checkpointed
        candidates, notes = select_candidates(tree, ac_units, fsdp_units)
        if relax:  # lower-bound mode: each module's cost is the LP relaxation of its op-level knapsack
            candidates = [relaxed_candidate(tree, c) for c in candidates]
        self._build(tree, timeline, candidates, notes, exact and not relax, max_options, solver)

    @classmethod
    def of_timeline(cls, timeline: Timeline, candidates: Sequence[Candidate]) -> "SacProblem":
        """The problem of a memory timeline and candidates built elsewhere (PyTorch's Graph, see
        :mod:`sacplan.solver.compat`): trade-off lines only, and no tree (``tree`` is None)."""
        self = cls.__new__(cls)
        self._build(None, timeline, list(candidates), [], False, None, "auto")  # type: ignore[arg-type]
        return self

    def _build(self, tree: ModuleTree, timeline: Timeline, candidates: list[Candidate], notes: list[str], exact: bool,
               max_options: int | None, solver: str) -> None:
        self.tree, self.timeline, self.world_size = tree, timeline, timeline.world_size
        self.candidates, self.notes = candidates, notes
        #: exact mode: candidates with ops choose among their op-level options (see :meth:`options`)
        self.exact = bool(exact)
        self.max_options = None if max_options is None else int(max_options)
        self._solver = solver
        self._options: dict[int, ModuleOptions | None] = {}
        self._surge: dict[int, tuple[int, ...]] = {}
        self._orders()
        self._events()

    # -- setup ----------------------------------------------------------------------------------------
    def _orders(self) -> None:
        slot_by_fqn = {c.fqn: c for c in self.candidates}

        def positions(entries: Sequence[tuple[str, int]], forward: bool) -> tuple[np.ndarray, ...]:
            pos, slots, amts, over, kc = [], [], [], [], [0]
            for k, (f, c) in enumerate(entries):
                cand = slot_by_fqn.get(f)
                if cand is not None and c < cand.calls:
                    pos.append(k)
                    slots.append(cand.slot)
                    amts.append(float(cand.act_bytes[c]))
                    # one per call (select_candidates); the forward's adds the casts autocast's cache holds
                    over.append(float(cand.fw_overhead(c) if forward else cand.overhead_bytes[c]))
                    kc.append(kc[-1] + 1)
                else:
                    kc.append(kc[-1])
            arr = lambda v, t=float: np.asarray(v, dtype=t)  # noqa: E731
            return arr(pos, np.int64), arr(slots, np.int64), arr(amts), arr(over), arr(kc, np.int64)

        tl = self.timeline
        #: candidate entries of fw_post_order: position in the order, slot, bytes A_{i,c} and overhead o_{i,c}
        #: (kept while checkpointed); kc_fw[k] = candidate entries among the first k. The forward overhead adds
        #: the call's parameter casts autocast's cache holds until the forward ends (Candidate.fw_overhead): its
        #: discard frees them at the backward events only
        self.fw_pos, self.fw_slot, self.fw_amt, self.fw_over, self.kc_fw = positions(tl.fw_entries, True)
        self.bw_pos, self.bw_slot, self.bw_amt, self.bw_over, self.kc_bw = positions(tl.bw_entries, False)

    def _events(self) -> None:
        tl = self.timeline
        slot_by_fqn = {c.fqn: c.slot for c in self.candidates}
        n = tl.num_events
        self.ev_k = tl.pos
        #: interleaved events (:attr:`~sacplan.timeline.Timeline.mixed`, pipeline schedules): rows on both running sums
        self.ev_mixed = tl.mixed
        self.ev_kf, self.ev_kb = tl.fw_pos, tl.bw_pos
        self.ev_base = tl.base
        self.ev_module = list(tl.module)
        self.ev_phase = tl.phase.copy()  # rc events where checkpointing adds nothing become bw rows
        active: list[list[int]] = [[] for _ in range(n)]
        for i, p in zip(tl.active_event.tolist(), tl.active_pos.tolist()):
            active[i].append(p)
        # What checkpointing a slot adds at an event, as sparse (event, slot, bytes) triples: the overhead of each
        # call inside its backward there (held until that backward ends) and, at a call's rc event, its
        # recompute transient and the RNG-state copy its recomputation holds (sacplan.evaluate.rng_copy_bytes).
        # (PyTorch's Graph, ``tree`` None, has no RNG state in its memory model: no copy)
        copy = [0.0 if self.tree is None else float(rng_copy_bytes(self.tree, c.fqn)) for c in self.candidates]
        t_ev: list[int] = []
        t_slot: list[int] = []
        t_coef: list[float] = []
        self.ev_terms: list[tuple[tuple[int, float], ...]] = []
        #: per event: the slot whose rc event it is when that slot's options can surge (else -1), see :meth:`surge`
        self.ev_surge = np.full(n, -1, dtype=np.int64)
        for i in range(n):
            ph = int(tl.phase[i])
            terms: dict[int, float] = {}
            if ph in (BW, RC):
                for p in active[i]:
                    if self.kc_bw[p + 1] > self.kc_bw[p]:  # a candidate's call (the timeline keeps p in range)
                        q = int(self.kc_bw[p])
                        if self.bw_over[q] > 0:
                            sl = int(self.bw_slot[q])
                            terms[sl] = terms.get(sl, 0.0) + float(self.bw_over[q])
                s = slot_by_fqn.get(tl.module[i], -1) if ph == RC else -1
                if s >= 0 and tl.extra[i] + copy[s] > 0:
                    terms[s] = terms.get(s, 0.0) + float(tl.extra[i]) + copy[s]
                if s >= 0 and max(self.surge(s), default=0) > 0:
                    self.ev_surge[i] = s
                    terms[s] = terms.get(s, 0.0)  # an rc row even where the full recomputation adds nothing
                self.ev_phase[i] = RC if terms else BW
            self.ev_terms.append(tuple(sorted(terms.items())))
            for sl, cf in terms.items():
                t_ev.append(i)
                t_slot.append(sl)
                t_coef.append(cf)
        self.t_ev = np.asarray(t_ev, dtype=np.int64)
        self.t_slot = np.asarray(t_slot, dtype=np.int64)
        self.t_coef = np.asarray(t_coef, dtype=float)

    # -- exact evaluation -------------------------------------------------------------------------------
    @property
    def num_candidates(self) -> int:
        return len(self.candidates)

    def options(self, slot: int) -> ModuleOptions | None:
        """Exact op-level options of candidate ``slot`` (:func:`~sacplan.solver.ops.module_options`, at most
        ``max_options``; None when not in exact mode or it has no ops), memoised per class of identical ones."""
        if not self.exact:
            return None
        if slot in self._options:
            return self._options[slot]
        c = self.candidates[slot]
        st = self.tree.nodes[c.node].stats
        t = st.tradeoff
        out: ModuleOptions | None = None
        if st.ops and t is not None and t.full_recompute_ms > 0:
            key = ("opts", c.max_discard_bytes, c.recompute_ms, st.ops, st.recompute_stop, st.buffer_bytes > 0)
            out = self._options.get(key)  # type: ignore[call-overload]
            if out is None:
                # a save list runs under the selective mode, whose dispatch the step pays (sacplan.sacmode)
                sel_frac, full_sel = dispatch_ms(st, self.tree.stats.device) / c.recompute_ms, full_runs_selective(st)
                out = module_options(
                    st.ops,
                    c.max_discard_bytes,
                    c.recompute_ms,
                    [p[0] for p in t.points],
                    recompute_stop=st.recompute_stop,
                    max_options=self.max_options,
                    solver=lp_solver(self._solver),
                    selective_frac=sel_frac,
                    full_selective=full_sel,
                )
                self._options[key] = out  # type: ignore[index]
        self._options[slot] = out
        return out

    def surge(self, slot: int) -> tuple[int, ...]:
        """Per option of candidate ``slot``: bytes its recomputation peaks above a full one's, at the slot's rc
        events (:func:`~sacplan.tradeoff.recompute_surge`; ``()`` without exact options). Memoised."""
        if slot not in self._surge:
            st = self.tree.nodes[self.candidates[slot].node].stats
            o = self.options(slot) if any(op.below_peak_bytes is not None for op in st.ops) else None
            self._surge[slot] = () if o is None else tuple(
                0 if sel is None else recompute_surge(st.ops, sel.saved, st.recompute_stop) for sel in o.selection
            )
        return self._surge[slot]

    def surge_top(self) -> np.ndarray:
        """Per event, the largest :meth:`surge` any option of the event's surge slot can add there (bytes; 0 at
        events without one): what a check safe for every option adds. Memoised."""
        if getattr(self, "_surge_top", None) is None:
            top = np.zeros(len(self.ev_base))
            for e in np.nonzero(self.ev_surge >= 0)[0]:
                top[e] = max(self.surge(int(self.ev_surge[e])))
            self._surge_top = top
        return self._surge_top

    def options_complete(self) -> bool:
        """True when every candidate picks among its *whole* Pareto front of save lists (exact mode,
        ``max_options=None``, no front thinned): the MILP then ranges over every plan."""
        return self.exact and all(
            c.recompute_ms <= 0.0 or ((o := self.options(c.slot)) is not None and o.complete) for c in self.candidates
        )  # a module that costs nothing to recompute is priced exactly by any line: 0

    def options_slack_ms(self) -> float:
        """Recompute ms the options may overprice because the time budget ran out while they were built
        (:attr:`~sacplan.solver.ops.ModuleOptions.slack_frac` over all calls): the MILP's bound minus this also
        bounds the plans over exact knapsacks at the same ratios."""
        total = 0.0
        for c in self.candidates:
            o = self.options(c.slot)
            if o is not None:
                total += c.calls * c.recompute_ms * o.slack_frac
        return float(total)

    def snap(self, y: Sequence[float], r: Sequence[float]) -> np.ndarray:
        """Ratios raised to the cheapest option discarding at least as much (exact candidates only)."""
        r = np.asarray(r, dtype=float).copy()
        for c in self.candidates:
            o = self.options(c.slot)
            if o is None:
                continue
            r[c.slot] = o.ratio[o.level_for(float(r[c.slot]))] if y[c.slot] > 0.5 else 0.0
        return r

    def call_freed(self, y: Sequence[float], r: Sequence[float], with_extra: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Per call of ``fw_post_order`` and of ``bw_pre_order``, the bytes decision ``(y, r)`` frees there
        (:meth:`~sacplan.timeline.Timeline.peaks`' ``fw_freed``/``bw_freed``): a checkpointed candidate's call
        discards ``A_{i,c}·r_i`` and keeps its overhead ``o_{i,c}`` (left out with ``with_extra=False``)."""
        y = np.asarray(y, dtype=float).reshape(-1)
        yb = (y > 0.5).astype(float)
        r = np.asarray(r, dtype=float).reshape(-1) * yb
        k = 1.0 if with_extra else 0.0
        tl = self.timeline
        fw = np.zeros(len(tl.fw_entries))
        bw = np.zeros(len(tl.bw_entries))
        if self.num_candidates:
            fw[self.fw_pos] = self.fw_amt * r[self.fw_slot] - k * self.fw_over * yb[self.fw_slot]
            bw[self.bw_pos] = self.bw_amt * r[self.bw_slot] - k * self.bw_over * yb[self.bw_slot]
        return fw, bw

    def peaks(self, y: Sequence[float], r: Sequence[float], with_extra: bool = True) -> np.ndarray:
        """Predicted bytes ``m_e`` at every event for checkpoint flags ``y`` and discard ratios ``r`` (per slot).

        ``with_extra=False`` leaves out what checkpointing adds (recompute transients, per-call overhead):
        a lower bound for screening."""
        if self.num_candidates == 0:
            return self.ev_base.copy()
        yb = (np.asarray(y, dtype=float).reshape(-1) > 0.5).astype(float)
        r = np.asarray(r, dtype=float).reshape(-1)
        tl = self.timeline
        added = None
        if with_extra and len(self.t_ev):
            added = np.bincount(self.t_ev, weights=self.t_coef * yb[self.t_slot], minlength=tl.num_events)
        m = tl.peaks(*self.call_freed(yb, r, with_extra), added)
        if with_extra:
            for i in np.nonzero(self.ev_surge >= 0)[0]:
                s = int(self.ev_surge[i])
                if yb[s]:
                    o = self.options(s)
                    assert o is not None
                    m[i] += self.surge(s)[o.level_for(float(r[s]))]
        return m

    def peak(self, y: Sequence[float], r: Sequence[float]) -> float:
        return float(np.max(self.peaks(y, r)))

    def baseline_peak(self) -> float:
        """Peak without checkpointing (per rank, at this world size), bytes (float)."""
        return float(np.max(self.ev_base))

    def cost(self, y: Sequence[float], r: Sequence[float]) -> float:
        """Model recompute ms of a decision: the trade-off lines, or (exact mode) the cheapest option
        discarding at least ``r``."""
        total = 0.0
        for c in self.candidates:
            if y[c.slot] <= 0.5:
                continue
            o = self.options(c.slot)
            if o is None:
                total += c.cost(float(r[c.slot]))
            else:
                total += c.calls * c.recompute_ms * o.frac[o.level_for(float(r[c.slot]))]
        return float(total)

    def classes(self) -> list[tuple[tuple, list[int]]]:
        """Candidates with identical numbers (calls, bytes per call, recompute ms, trade-off lines), by slot."""
        groups: dict[tuple, list[int]] = {}
        for c in self.candidates:
            key = (c.calls, c.act_bytes, c.max_discard_bytes, c.recompute_ms, c.slopes, c.intercepts, c.overhead_bytes,
                   c.cache_held_bytes)
            groups.setdefault(key, []).append(c.slot)
        return sorted(groups.items(), key=lambda kv: kv[1][0])

    def ancestors(self, slot: int) -> list[int]:
        """The candidate slots ``slot`` lies inside, nearest first (smaller slots: pre-order)."""
        out, p = [], self.candidates[slot].parent_slot
        while p >= 0:
            out.append(p)
            p = self.candidates[p].parent_slot
        return out

    def nesting_ok(self, y: Sequence[float]) -> bool:
        """No checkpointed candidate lies inside another."""
        return not any(y[c.slot] > 0.5 and any(y[p] > 0.5 for p in self.ancestors(c.slot)) for c in self.candidates)

    def lower_bound_peak(self) -> float:
        """A quick lower bound of the smallest achievable peak: every candidate fully discarded at once
        (nesting ignored) and no recompute extras."""
        ones = np.ones(self.num_candidates)
        return float(np.max(self.peaks(ones, ones, with_extra=False)))

    def sequential(self, members: Sequence[int]) -> list[int] | None:
        """Identical candidates in forward order when each runs once and their backwards run in reverse order
        (sequential blocks); else None. Giving the earlier of two *checkpointed* members the larger discard then
        never raises an event: every running sum ``F`` (forwards finished) and ``D - B`` (backwards not yet
        started) covers a prefix of the forward order, so the swap only raises the sums between them, and the
        recompute extras stay. The MILP's ordering rows cut off no optimum, only symmetric copies."""
        if any(self.candidates[s].calls != 1 or max(self.surge(s), default=0) > 0 for s in members):
            return None  # a surge sits at the member's own rc event, not in a running sum: the swap may raise it
        fw_pos = {int(sl): p for p, sl in enumerate(self.fw_slot)}
        bw_pos = {int(sl): p for p, sl in enumerate(self.bw_slot)}
        if any(s not in fw_pos or s not in bw_pos for s in members):
            return None
        seq = sorted(members, key=lambda s: fw_pos[s])
        if any(bw_pos[a] <= bw_pos[b] for a, b in zip(seq, seq[1:])):
            return None
        return seq

    def linear_terms(self) -> tuple[np.ndarray, np.ndarray]:
        """``(C, Y)`` with ``peaks(y, r) == ev_base - C @ r + Y @ y`` for 0/1 ``y`` (events × candidates, bytes), but
        the option-dependent :meth:`surge` at rc events: ``C[e, s]`` the bytes of ``s``'s calls event ``e`` counts as
        discarded, ``Y[e, s]`` what checkpointing ``s`` adds there (its per-call overhead from its forward to the end
        of its backward, its recompute transient and RNG-state copy at its rc events), both by the timeline's
        :meth:`~sacplan.timeline.Timeline.freed`. Memoised."""
        if getattr(self, "_lin", None) is None:
            tl, nc = self.timeline, self.num_candidates

            def per_slot(pos: np.ndarray, slot: np.ndarray, amount: np.ndarray, calls: int) -> np.ndarray:
                out = np.zeros((calls, nc))
                out[pos, slot] = amount  # one candidate per call of an order
                return out

            nf, nb = len(tl.fw_entries), len(tl.bw_entries)
            C = tl.freed(per_slot(self.fw_pos, self.fw_slot, self.fw_amt, nf),
                         per_slot(self.bw_pos, self.bw_slot, self.bw_amt, nb))
            Y = tl.freed(per_slot(self.fw_pos, self.fw_slot, self.fw_over, nf),
                         per_slot(self.bw_pos, self.bw_slot, self.bw_over, nb))
            if len(self.t_ev):
                np.add.at(Y, (self.t_ev, self.t_slot), self.t_coef)
            self._lin = (C, Y)
        return self._lin
