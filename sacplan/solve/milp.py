"""Module-level MILP: which modules to checkpoint and what fraction of each one's activations to discard.

See :func:`solve` for the memory model and the formulation. The pieces:

* :mod:`sacplan.solve.candidates` picks the modules that may be checkpointed and their trade-off lines;
* :class:`SacProblem` reads a :class:`~sacplan.tree.ModuleTree` once (candidates, the step orders as
  running-sum positions, the memory timeline with per-rank state scaling) and evaluates any decision
  exactly in bytes (:meth:`SacProblem.peaks`);
* :meth:`SacProblem.build` writes the budget MILP, :meth:`SacProblem.build_min_peak` the MILP whose
  optimum is the smallest feasible budget;
* :meth:`SacProblem.heuristic` finds a good feasible incumbent (LP relaxation, rounding, LP re-solve over
  ratios) that the branch-and-bound starts from;
* :func:`solve` ties it together, realises the ratios with op-level selection
  (:func:`sacplan.solve.ops.select_ops`) and returns a :class:`~sacplan.plan.Plan`.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from sacplan.devices import checkpoint_state_bytes
from sacplan.errors import ConfigError, InfeasibleBudgetError, SolverError
from sacplan.plan import ModuleDecision, Plan
from sacplan.solve.backends import (
    INFEASIBLE,
    OPTIMAL,
    TIME_LIMIT,
    MilpModel,
    SolveResult,
    check_solver,
    interrupted_result,
    lp_solver,
    prove_by_lp_branching,
    relative_gap,
    relaxed,
    relaxed_with_fixed,
    solve_model,
)
from sacplan.solve import limits
from sacplan.solve.candidates import Candidate, relaxed_candidate, select_candidates
from sacplan.solve.limits import (
    DEFAULT_SOLVE_S,
    SolveInterrupted,
    check_time_limit,
    deadline,
    lifted,
    time_limit_message,
)
from sacplan.stats import Phase
from sacplan.tradeoff import recompute_surge
from sacplan.solve.ops import ModuleOptions, max_saved_bytes_for, module_options, select_ops
from sacplan.tree import ModuleTree
from sacplan.units import Bytes, GiB, parse_budget


FW, BW, RC, OTHER = 0, 1, 2, 3  # phase codes in the event arrays
_PHASES = {Phase.FW: FW, Phase.BW: BW, Phase.RC: RC, Phase.OTHER: OTHER}


#: Seconds the heuristic may spend on a min-peak MILP for its first plan when its roundings all fail, even when
#: a quarter of the time limit is less (BERT-large: 0.15 s)
_FIRST_PLAN_S = 0.5


class TimeLimitWarning(UserWarning):
    """The solver stopped at its time limit; the plan is the best found, with the gap stated."""

@dataclass
class _Index:
    """Column indices of one built model."""

    y: list[int] = field(default_factory=list)
    r: list[int] = field(default_factory=list)
    q: dict[int, int] = field(default_factory=dict)  # slot -> q column (trade-off-line candidates)
    w: dict[int, list[int]] = field(default_factory=dict)  # slot -> option-level columns (exact candidates)
    N: list[tuple[int, list[int], int]] = field(default_factory=list)  # (count column, class slots, level)
    u: dict[int, int] = field(default_factory=dict)
    K: list[int] = field(default_factory=list)
    F: list[tuple[int, int]] = field(default_factory=list)  # (kc, column), kc ascending
    G: list[tuple[int, int]] = field(default_factory=list)  # (kc, column), kc descending
    P: int = -1
    pruned_events: int = 0
    kept_events: int = 0


class SacProblem:
    """Budget-independent view of a tree for the MILP (see :func:`solve` for the model).

    Args:
        tree: the collected module tree.
        world_size: ranks to plan for (None: the tree's own ``stats.world_size``).
        ac_units: allowed checkpoint units (None: every eligible module).
        fsdp_units: FSDP units; no checkpoint unit may be an ancestor of one.
    """

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
        stats = tree.stats
        self.tree = tree
        #: exact mode: candidates with ops choose among their op-level options (see :meth:`options`)
        self.exact = bool(exact)
        self.max_options = None if max_options is None else int(max_options)
        self._solver = solver
        self._options: dict[int, ModuleOptions | None] = {}
        self._surge: dict[int, tuple[int, ...]] = {}
        base_ws = max(1, int(stats.world_size))
        if world_size is None:
            world_size = base_ws
        if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
            raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
        self.world_size = int(world_size)
        #: state bytes kept per rank, relative to the collected ones
        self.state_keep = base_ws / self.world_size
        #: bytes each checkpointed call keeps besides its saved tensors (the stashed RNG state on a CPU target)
        self.ck_overhead = float(checkpoint_state_bytes(stats.device))
        #: candidates in pre-order (slot = index), and warnings about named ``ac_units`` that cannot be checkpointed
        self.candidates, self.notes = select_candidates(tree, ac_units, fsdp_units, self.ck_overhead)
        if relax:  # lower-bound mode: each module's cost is the LP relaxation of its op-level knapsack
            self.exact = False
            self.candidates = [relaxed_candidate(tree, c) for c in self.candidates]
        self._orders(tree)
        self._events(tree)

    # -- setup ----------------------------------------------------------------------------------------
    def _orders(self, tree: ModuleTree) -> None:
        slot_by_fqn = {c.fqn: c for c in self.candidates}

        def positions(order: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
            seen: dict[str, int] = {}
            slots, amts, over, kc = [], [], [], [0]
            for f in order:
                c = seen.get(f, 0)
                seen[f] = c + 1
                cand = slot_by_fqn.get(f)
                if cand is not None and c < cand.calls:
                    slots.append(cand.slot)
                    amts.append(float(cand.act_bytes[c]))
                    over.append(float(cand.overhead_bytes[c]) if c < len(cand.overhead_bytes) else self.ck_overhead)
                    kc.append(kc[-1] + 1)
                else:
                    kc.append(kc[-1])
            arr = lambda v, t=float: np.asarray(v, dtype=t)  # noqa: E731
            return arr(slots, np.int64), arr(amts), arr(over), arr(kc, np.int64)

        st = tree.stats
        #: candidate entries of fw_post_order: slot, bytes A_{i,c} and overhead o_{i,c} (kept while checkpointed);
        #: kc_fw[k] = candidate entries among the first k
        self.fw_slot, self.fw_amt, self.fw_over, self.kc_fw = positions(st.fw_post_order)
        self.bw_slot, self.bw_amt, self.bw_over, self.kc_bw = positions(st.bw_pre_order)

    def _events(self, tree: ModuleTree) -> None:
        st = tree.stats
        events = list(st.events)
        if not events:  # no timeline: the whole-step peak, unchanged by checkpointing
            from sacplan.stats import MemoryEvent

            events = [
                MemoryEvent(Phase.OTHER, "", 0, 0, 0, int(st.peak_bytes), int(st.peak_snapshot.state)),
            ]
        slot_by_fqn = {c.fqn: c.slot for c in self.candidates}
        n = len(events)
        self.ev_phase = np.empty(n, dtype=np.int64)
        self.ev_k = np.zeros(n, dtype=np.int64)
        self.ev_base = np.empty(n, dtype=float)
        self.ev_module = [e.module for e in events]
        shed = 1.0 - self.state_keep
        nf, nb = len(st.fw_post_order), len(st.bw_pre_order)
        # What checkpointing a slot adds at an event, as sparse (event, slot, bytes) triples: the overhead of each
        # call inside its backward there (held until that backward ends) and, at a call's rc event, its
        # recompute transient.
        active = st.backward_active() if st.events else [()] * n
        t_ev: list[int] = []
        t_slot: list[int] = []
        t_coef: list[float] = []
        self.ev_terms: list[tuple[tuple[int, float], ...]] = []
        #: per event: the slot whose rc event it is when that slot's options can surge (else -1), see :meth:`surge`
        self.ev_surge = np.full(n, -1, dtype=np.int64)
        for i, e in enumerate(events):
            ph = _PHASES.get(e.phase)
            if ph is None:
                raise ConfigError(f"memory event {i} has unknown phase {e.phase!r} (expected fw, bw, rc or other)")
            self.ev_base[i] = float(e.peak_bytes) - float(e.state_bytes) * shed
            terms: dict[int, float] = {}
            if ph == FW:
                self.ev_k[i] = min(max(int(e.fw_done), 0), nf)
            elif ph in (BW, RC):
                self.ev_k[i] = min(max(int(e.bw_started), 0), nb)
                for p in active[i]:
                    if p < nb and self.kc_bw[p + 1] > self.kc_bw[p]:
                        q = int(self.kc_bw[p])
                        if self.bw_over[q] > 0:
                            sl = int(self.bw_slot[q])
                            terms[sl] = terms.get(sl, 0.0) + float(self.bw_over[q])
                s = slot_by_fqn.get(e.module, -1) if ph == RC else -1
                if s >= 0 and e.extra_bytes > 0:
                    terms[s] = terms.get(s, 0.0) + float(e.extra_bytes)
                if s >= 0 and max(self.surge(s), default=0) > 0:
                    self.ev_surge[i] = s
                    terms[s] = terms.get(s, 0.0)  # an rc row even where the full recomputation adds nothing
                ph = RC if terms else BW
            self.ev_phase[i] = ph
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
        """Exact op-level options of candidate ``slot`` (None when not in exact mode or it has no ops).

        The module's exact Pareto front of save lists (:func:`~sacplan.solve.ops.module_options`), pruned to
        ``max_options`` (None: all of it), memoised per class of identical candidates.
        """
        if not self.exact:
            return None
        if slot in self._options:
            return self._options[slot]
        c = self.candidates[slot]
        st = self.tree.nodes[c.node].stats
        t = st.tradeoff
        out: ModuleOptions | None = None
        if st.ops and t is not None and t.full_recompute_ms > 0:
            key = ("opts", c.max_discard_bytes, c.recompute_ms, st.ops, st.recompute_stop)
            out = self._options.get(key)  # type: ignore[call-overload]
            if out is None:
                out = module_options(
                    st.ops,
                    c.max_discard_bytes,
                    c.recompute_ms,
                    [p[0] for p in t.points],
                    recompute_stop=st.recompute_stop or None,
                    max_options=self.max_options,
                    solver=lp_solver(self._solver),
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

    def options_complete(self) -> bool:
        """True when every candidate picks among its *whole* Pareto front of save lists (exact mode,
        ``max_options=None``, no front thinned): the MILP then ranges over every plan."""
        return self.exact and all(
            c.recompute_ms <= 0.0 or ((o := self.options(c.slot)) is not None and o.complete) for c in self.candidates
        )  # a module that costs nothing to recompute is priced exactly by any line: 0

    def options_slack_ms(self) -> float:
        """Recompute ms the options may overprice because the time budget ran out while they were built
        (:attr:`~sacplan.solve.ops.ModuleOptions.slack_frac`, over all calls of every candidate): the MILP's
        bound minus this also bounds the plans over exact knapsacks at the same ratios. 0.0 when none was cut
        short."""
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

    def peaks(self, y: Sequence[float], r: Sequence[float], with_extra: bool = True) -> np.ndarray:
        """Predicted bytes ``m_e`` at every event for checkpoint flags ``y`` and discard ratios ``r`` (per slot).

        ``with_extra=False`` leaves out what checkpointing adds (recompute transients, per-call overhead):
        a lower bound for screening."""
        y = np.asarray(y, dtype=float).reshape(-1)
        yb = (y > 0.5).astype(float)
        r = np.asarray(r, dtype=float).reshape(-1) * yb
        m = self.ev_base.copy()
        if self.num_candidates == 0:
            return m
        k = 1.0 if with_extra else 0.0
        F = np.concatenate([[0.0], np.cumsum(self.fw_amt * r[self.fw_slot] - k * self.fw_over * yb[self.fw_slot])])
        B = np.concatenate([[0.0], np.cumsum(self.bw_amt * r[self.bw_slot] - k * self.bw_over * yb[self.bw_slot])])
        D = B[-1]
        ph = self.ev_phase
        fw = ph == FW
        m[fw] -= F[self.kc_fw[self.ev_k[fw]]]
        bw = (ph == BW) | (ph == RC)
        m[bw] -= D - B[self.kc_bw[self.ev_k[bw]]]
        if with_extra and len(self.t_ev):
            m += np.bincount(self.t_ev, weights=self.t_coef * yb[self.t_slot], minlength=len(m))
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
            key = (c.calls, c.act_bytes, c.max_discard_bytes, c.recompute_ms, c.slopes, c.intercepts, c.overhead_bytes)
            groups.setdefault(key, []).append(c.slot)
        return sorted(groups.items(), key=lambda kv: kv[1][0])

    def nesting_ok(self, y: Sequence[float]) -> bool:
        for c in self.candidates:
            if y[c.slot] > 0.5:
                p = c.parent_slot
                while p >= 0:
                    if y[p] > 0.5:
                        return False
                    p = self.candidates[p].parent_slot
        return True

    def lower_bound_peak(self) -> float:
        """A quick lower bound of the smallest achievable peak: every candidate fully discarded at once
        (nesting ignored) and no recompute extras."""
        ones = np.ones(self.num_candidates)
        return float(np.max(self.peaks(ones, ones, with_extra=False)))

    # -- event selection ----------------------------------------------------------------------------------
    def _select_events(
        self, budget: float | None
    ) -> tuple[list[tuple[int, float]], list[tuple[int, float]], list[tuple[int, tuple[tuple[int, float], ...], float, int]], float, int]:
        """Constraints that remain after pruning and dominance.

        Returns ``fw`` [(kc, need)] kc ascending, ``bw`` [(kc, need)] kc descending, ``rc``
        [(kc, ((slot, bytes added if checkpointed), ...), need, surge slot)] for the events where checkpointing
        adds bytes (surge slot: the slot whose option-dependent :meth:`surge` the event adds, else -1),
        the largest ``other`` need, and the number of events dropped. ``need`` is
        ``base - budget`` (or ``base`` when ``budget`` is None, for the min-peak model).
        """
        b = 0.0 if budget is None else float(budget)
        need = self.ev_base - b
        ph = self.ev_phase
        n_total = len(need)
        other = float(np.max(need[ph == OTHER])) if np.any(ph == OTHER) else -math.inf
        prune = budget is not None
        # forward: F non-decreasing in kc -> keep strictly increasing needs along kc
        fw_best: dict[int, float] = {}
        # checkpointing can also *add* bytes (the per-call overhead): keep events that overhead could push over
        slack = max(float(self.fw_over.sum()), float(self.bw_over.sum()))
        sel = np.nonzero((ph == FW) & ((need + slack > 0) if prune else True))[0]
        for i in sel:
            kc = int(self.kc_fw[self.ev_k[i]])
            if need[i] > fw_best.get(kc, -math.inf):
                fw_best[kc] = float(need[i])
        # dominance needs monotone running sums: d = A·r - o·y >= 0 for every call, which the rows
        # r >= min_ratio·y of :meth:`_base_columns` guarantee (see :attr:`~sacplan.solve.candidates.Candidate.min_ratio`)
        dominate = True
        fw, run = [], -math.inf
        for kc in sorted(fw_best):
            if fw_best[kc] > run or not dominate:
                fw.append((kc, fw_best[kc]))
                run = fw_best[kc]
        # backward: G (discards not yet re-materialised) non-increasing in kc
        bw_best: dict[int, float] = {}
        sel = np.nonzero((ph == BW) & ((need + slack > 0) if prune else True))[0]
        for i in sel:
            kc = int(self.kc_bw[self.ev_k[i]])
            if need[i] > bw_best.get(kc, -math.inf):
                bw_best[kc] = float(need[i])
        bw, run = [], -math.inf
        for kc in sorted(bw_best, reverse=True):
            if bw_best[kc] > run or not dominate:
                bw.append((kc, bw_best[kc]))
                run = bw_best[kc]
        # events where checkpointing adds bytes (rc events, calls inside their backward): Pareto-maximal
        # (need, added bytes) per (kc, slots)
        groups: dict[tuple[int, tuple[int, ...], int], list[tuple[float, tuple[float, ...]]]] = {}
        for i in np.nonzero(ph == RC)[0]:
            terms = self.ev_terms[i]
            ss = int(self.ev_surge[i])
            top = max(self.surge(ss)) if ss >= 0 else 0
            if prune and need[i] + slack + sum(cf for _, cf in terms) + top <= 0:
                continue
            key = (int(self.kc_bw[self.ev_k[i]]), tuple(sl for sl, _ in terms), ss)
            groups.setdefault(key, []).append((float(need[i]), tuple(cf for _, cf in terms)))
        rc: list[tuple[int, tuple[tuple[int, float], ...], float, int]] = []
        for key in sorted(groups):
            kept_coefs: list[tuple[float, ...]] = []
            for nd, cfs in sorted(groups[key], key=lambda t: (-t[0], tuple(-c for c in t[1]))):
                if not any(all(a >= b for a, b in zip(k, cfs)) for k in kept_coefs):
                    rc.append((key[0], tuple(zip(key[1], cfs)), nd, key[2]))
                    kept_coefs.append(cfs)
        kept = len(fw) + len(bw) + len(rc) + (1 if other > -math.inf else 0)
        return fw, bw, rc, other, n_total - kept

    # -- model building -------------------------------------------------------------------------------------
    def _base_columns(self, model: MilpModel, idx: _Index, with_cost: bool) -> None:
        for c in self.candidates:
            idx.y.append(model.add_col(f"y{c.slot}", 0.0, 1.0, True))
            idx.r.append(model.add_col(f"r{c.slot}", 0.0, 1.0))
        for c in self.candidates:
            s = c.slot
            model.add_row(f"ry{s}", [idx.r[s], idx.y[s]], [1.0, -1.0], ub=0.0)
            if c.min_ratio > 0:  # a checkpointed call frees at least what it keeps (see Candidate.min_ratio)
                model.add_row(f"rmin{s}", [idx.r[s], idx.y[s]], [1.0, -c.min_ratio], lb=0.0)
        # no nested checkpointing: U_i = U_parent + y_i <= 1 along candidate chains
        for c in self.candidates:
            s = c.slot
            if c.parent_slot < 0:
                continue
            p = c.parent_slot
            up = idx.u.get(p, idx.y[p])
            if c.has_child:
                idx.u[s] = model.add_col(f"u{s}", 0.0, 1.0)
                model.add_row(f"nest{s}", [idx.u[s], up, idx.y[s]], [1.0, -1.0, -1.0], lb=0.0, ub=0.0)
            else:
                model.add_row(f"nest{s}", [up, idx.y[s]], [1.0, 1.0], ub=1.0)
        if with_cost:
            # Identical candidates (repeated blocks) form a class; K = Σ_{class} y is integer. The row is
            # redundant (valid for any grouping) but lets branch-and-bound branch on *how many* blocks to
            # checkpoint instead of on which, the source of the symmetric stall.
            for key, members in self.classes():
                if len(members) < 2:
                    continue
                k = model.add_col(f"K{members[0]}", 0.0, float(len(members)), True)
                idx.K.append(k)
                model.add_row(f"Kdef{members[0]}", [k] + [idx.y[s] for s in members], [1.0] + [-1.0] * len(members), lb=0.0, ub=0.0)
            for c in self.candidates:
                s = c.slot
                w = c.calls * c.recompute_ms
                o = self.options(s)
                if o is not None:
                    # exact: y picks option 0, level columns w_k (ordered) step up to option k:
                    # r = r_0·y + Σ (r_k - r_{k-1})·w_k, cost = R·(q_0·y + Σ (q_k - q_{k-1})·w_k)
                    model.col_cost[idx.y[s]] = w * o.frac[0]
                    cols = []
                    for k in range(1, len(o.ratio)):
                        cols.append(model.add_col(f"w{s}_{k}", 0.0, 1.0, True, w * (o.frac[k] - o.frac[k - 1])))
                        prev = idx.y[s] if k == 1 else cols[-2]
                        model.add_row(f"wo{s}_{k}", [cols[-1], prev], [1.0, -1.0], ub=0.0)
                    idx.w[s] = cols
                    model.add_row(
                        f"rdef{s}",
                        [idx.r[s], idx.y[s]] + cols,
                        [1.0, -o.ratio[0]] + [-(o.ratio[k] - o.ratio[k - 1]) for k in range(1, len(o.ratio))],
                        lb=0.0,
                        ub=0.0,
                    )
                    continue
                idx.q[s] = model.add_col(f"q{s}", 0.0, math.inf, False, w)
                for li, (sl, ic) in enumerate(zip(c.slopes, c.intercepts)):
                    if sl <= 0 and ic <= 0:
                        continue  # implied by q >= 0
                    model.add_row(f"line{s}_{li}", [idx.q[s], idx.r[s], idx.y[s]], [1.0, -sl, -ic], lb=0.0)
            # exact classes: how many members reach each option level (integer, branched on with K)
            for key, members in self.classes():
                if len(members) < 2 or members[0] not in idx.w:
                    continue
                for k in range(len(idx.w[members[0]])):
                    n = model.add_col(f"N{members[0]}_{k + 1}", 0.0, float(len(members)), True)
                    idx.N.append((n, members, k))
                    model.add_row(
                        f"Ndef{members[0]}_{k + 1}",
                        [n] + [idx.w[s][k] for s in members],
                        [1.0] + [-1.0] * len(members),
                        lb=0.0,
                        ub=0.0,
                    )
                # Symmetry breaking (valid, see :meth:`_sequential`): of two checkpointed members, the earlier one
                # (forward order) reaches every level the later one does: w_{j,k} <= w_{i,k} + 1 - y_i.
                seq = self._sequential(members)
                if seq is not None:
                    for i, j in zip(seq, seq[1:]):
                        for k in range(len(idx.w[i])):
                            model.add_row(f"sym{i}_{j}_{k + 1}", [idx.w[j][k], idx.w[i][k], idx.y[i]], [1.0, -1.0, 1.0], ub=1.0)

    def _sequential(self, members: Sequence[int]) -> list[int] | None:
        """Identical candidates in forward order when each runs once and their backwards run in reverse
        order (sequential blocks); else None.

        For such a class, giving the earlier of two *checkpointed* members the larger discard never raises
        any event: every running sum ``F`` (forwards finished) and ``D - B`` (backwards not yet started)
        covers a prefix of the forward order, so swapping two members' discards into decreasing order only
        raises the sums between them, and the recompute extras stay (both remain checkpointed). So the
        ordering rows cut off no optimum, only symmetric copies of it.
        """
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

    def _sums(
        self,
        model: MilpModel,
        idx: _Index,
        fw_kcs: Sequence[int],
        bw_kcs: Sequence[int],
        fw_lb: dict[int, float],
        bw_lb: dict[int, float],
    ) -> tuple[dict[int, int], dict[int, int]]:
        """Running-sum columns F_kc (forward discards so far) and G_kc (discards not yet re-materialised)."""
        Fcol: dict[int, int] = {}
        prev_col, prev_kc = -1, 0
        for kc in sorted(set(fw_kcs)):
            col = model.add_col(f"F{kc}", fw_lb.get(kc, -math.inf), math.inf)
            ind, val = [col], [1.0]
            if prev_col >= 0:
                ind.append(prev_col)
                val.append(-1.0)
            for p in range(prev_kc, kc):
                ind.append(idx.r[int(self.fw_slot[p])])
                val.append(-self.fw_amt[p] / GiB)
                if self.fw_over[p]:
                    ind.append(idx.y[int(self.fw_slot[p])])
                    val.append(self.fw_over[p] / GiB)
            model.add_row(f"Fdef{kc}", ind, val, lb=0.0, ub=0.0)
            Fcol[kc] = col
            idx.F.append((kc, col))
            prev_col, prev_kc = col, kc
        Gcol: dict[int, int] = {}
        total = len(self.bw_slot)
        prev_col, prev_kc = -1, total
        for kc in sorted(set(bw_kcs), reverse=True):
            col = model.add_col(f"G{kc}", bw_lb.get(kc, -math.inf), math.inf)
            ind, val = [col], [1.0]
            if prev_col >= 0:
                ind.append(prev_col)
                val.append(-1.0)
            for p in range(kc, prev_kc):
                ind.append(idx.r[int(self.bw_slot[p])])
                val.append(-self.bw_amt[p] / GiB)
                if self.bw_over[p]:
                    ind.append(idx.y[int(self.bw_slot[p])])
                    val.append(self.bw_over[p] / GiB)
            model.add_row(f"Gdef{kc}", ind, val, lb=0.0, ub=0.0)
            Gcol[kc] = col
            idx.G.append((kc, col))
            prev_col, prev_kc = col, kc
        return Fcol, Gcol

    def build(self, budget: float) -> tuple[MilpModel, _Index, bool]:
        """The budget MILP (minimise recompute ms). Returns (model, index, trivially_infeasible)."""
        fw, bw, rc, other, pruned = self._select_events(budget)
        model = MilpModel(name="sacplan_sac")
        idx = _Index(pruned_events=pruned, kept_events=len(fw) + len(bw) + len(rc))
        self._base_columns(model, idx, with_cost=True)
        infeasible = other > 0 or any(kc == 0 and nd > 0 for kc, nd in fw) or any(
            kc == len(self.bw_slot) and nd > 0 for kc, nd in bw
        )
        Fcol, Gcol = self._sums(
            model,
            idx,
            [kc for kc, _ in fw],
            [kc for kc, _ in bw] + [kc for kc, *_ in rc],
            {kc: nd / GiB for kc, nd in fw},
            {kc: nd / GiB for kc, nd in bw},
        )
        for j, (kc, terms, nd, ss) in enumerate(rc):
            ind, val = self._added(idx, terms, ss)
            model.add_row(f"rc{j}_{kc}", [Gcol[kc]] + ind, [1.0] + [-v for v in val], lb=nd / GiB)
        return model, idx, infeasible

    def _added(self, idx: _Index, terms: Sequence[tuple[int, float]], ss: int) -> tuple[list[int], list[float]]:
        """Columns and GiB coefficients of what checkpointing adds at an rc event: ``terms`` on the ``y`` columns
        and, for the surge slot ``ss``, its option-dependent surge on its level columns (option 0 on ``y``:
        ``surge_0·y + Σ_k (surge_k - surge_{k-1})·w_k``, exact for the option the levels pick)."""
        coef = {idx.y[s]: cf / GiB for s, cf in terms}
        if ss >= 0 and ss in idx.w:
            sg = self.surge(ss)
            coef[idx.y[ss]] = coef.get(idx.y[ss], 0.0) + sg[0] / GiB
            for k, col in enumerate(idx.w[ss], start=1):
                if sg[k] != sg[k - 1]:
                    coef[col] = (sg[k] - sg[k - 1]) / GiB
        return list(coef), list(coef.values())

    def build_min_peak(self) -> tuple[MilpModel, _Index]:
        """The MILP minimising the predicted peak P (GiB) under the same structural constraints."""
        fw, bw, rc, other, pruned = self._select_events(None)
        model = MilpModel(name="sacplan_minpeak")
        idx = _Index(pruned_events=pruned, kept_events=len(fw) + len(bw) + len(rc))
        self._base_columns(model, idx, with_cost=False)
        lbP = max([0.0, other / GiB if other > -math.inf else 0.0])
        idx.P = model.add_col("P", lbP, math.inf, False, 1.0)
        Fcol, Gcol = self._sums(
            model, idx, [kc for kc, _ in fw], [kc for kc, _ in bw] + [kc for kc, *_ in rc], {}, {}
        )
        for kc, base in fw:
            model.add_row(f"pf{kc}", [Fcol[kc], idx.P], [1.0, 1.0], lb=base / GiB)
        for kc, base in bw:
            model.add_row(f"pb{kc}", [Gcol[kc], idx.P], [1.0, 1.0], lb=base / GiB)
        for j, (kc, terms, base, ss) in enumerate(rc):
            ind, val = self._added(idx, terms, ss)
            model.add_row(f"pr{j}_{kc}", [Gcol[kc], idx.P] + ind, [1.0, 1.0] + [-v for v in val], lb=base / GiB)
        return model, idx

    # -- solutions ----------------------------------------------------------------------------------------
    def columns_for(self, model: MilpModel, idx: _Index, y: Sequence[float], r: Sequence[float]) -> list[float]:
        """A full column vector for decision (y, r) (q, u, F, G, P filled in consistently)."""
        x = [0.0] * model.num_cols
        y = [1.0 if v > 0.5 else 0.0 for v in y]
        r = [float(min(1.0, max(0.0, rv))) * yv for rv, yv in zip(r, y)]
        if idx.w:
            r = [float(v) for v in self.snap(y, r)]
            # The symmetry rows want, in a class of identical sequential blocks, the earlier checkpointed block
            # at the larger discard; sort the discards so (same cost, no event higher: see _sequential). Else
            # the warm start violates them and the solver drops it.
            for _, members in self.classes():
                seq = self._sequential(members) if len(members) >= 2 and members[0] in idx.w else None
                on = [s for s in (seq or []) if y[s] > 0.5]
                for s, v in zip(on, sorted((r[s] for s in on), reverse=True)):
                    r[s] = v
        for c in self.candidates:
            s = c.slot
            x[idx.y[s]] = y[s]
            x[idx.r[s]] = r[s]
            if s in idx.q:
                x[idx.q[s]] = max([0.0] + [sl * r[s] + ic * y[s] for sl, ic in zip(c.slopes, c.intercepts)])
            if s in idx.w and y[s] > 0.5:
                o = self.options(s)
                assert o is not None
                for k in range(o.level_for(r[s])):
                    x[idx.w[s][k]] = 1.0
        for col, members, k in idx.N:
            x[col] = float(sum(x[idx.w[s][k]] for s in members))
        if idx.K:
            ks = [members for _, members in self.classes() if len(members) >= 2]
            for col, members in zip(idx.K, ks):
                x[col] = float(sum(y[s] for s in members))
        for c in self.candidates:  # pre-order: parents first
            if c.slot in idx.u:
                p = c.parent_slot
                up = x[idx.u[p]] if p in idx.u else y[p]
                x[idx.u[c.slot]] = up + y[c.slot]
        ra = np.asarray(r)
        ya = np.asarray(y)
        if len(self.fw_slot):
            F = np.concatenate([[0.0], np.cumsum((self.fw_amt * ra[self.fw_slot] - self.fw_over * ya[self.fw_slot]) / GiB)])
            for kc, col in idx.F:
                x[col] = float(F[kc])
        if len(self.bw_slot):
            B = np.concatenate([[0.0], np.cumsum((self.bw_amt * ra[self.bw_slot] - self.bw_over * ya[self.bw_slot]) / GiB)])
            for kc, col in idx.G:
                x[col] = float(B[-1] - B[kc])
        if idx.P >= 0:
            x[idx.P] = self.peak(y, r) / GiB
        return x

    def decision_from(self, idx: _Index, x: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
        y = np.array([1.0 if x[j] > 0.5 else 0.0 for j in idx.y])
        r = np.array([min(1.0, max(0.0, x[j])) for j in idx.r]) * y
        for s, cols in idx.w.items():  # exact candidates: the option level from the level columns
            o = self.options(s)
            if o is not None and y[s] > 0.5:
                r[s] = o.ratio[int(sum(1 for j in cols if x[j] > 0.5))]
        return y, r

    def repair(self, y: np.ndarray, r: np.ndarray, budget: float, max_iter: int | None = None) -> np.ndarray | None:
        """Raise discard ratios of checkpointed modules until every event fits ``budget`` exactly in bytes.

        Solvers work to a feasibility tolerance (~1 byte here); this removes such tiny violations (it only
        ever raises ratios, which lowers every event). Returns the repaired ratios, or None if impossible.
        """
        r = r.copy()
        max_iter = max_iter or (4 * len(self.ev_base) + 16)
        for _ in range(max_iter):
            m = self.peaks(y, r)
            e = int(np.argmax(m))
            viol = m[e] - budget
            if viol <= 0:
                return r
            ph, k = self.ev_phase[e], int(self.ev_k[e])
            weight = np.zeros(self.num_candidates)
            if ph == FW:
                kc = int(self.kc_fw[k])
                np.add.at(weight, self.fw_slot[:kc], self.fw_amt[:kc])
            elif ph in (BW, RC):
                kc = int(self.kc_bw[k])
                np.add.at(weight, self.bw_slot[kc:], self.bw_amt[kc:])
            else:
                return None
            room = weight * (1.0 - r) * (y > 0.5)
            if room.sum() < viol:
                return None
            s = int(np.argmax(room))
            r[s] = min(1.0, r[s] + (viol * (1 + 1e-12) + 1e-3) / weight[s])
        return None

    # -- heuristic incumbent ----------------------------------------------------------------------------
    def heuristic(
        self, model: MilpModel, idx: _Index, budget: float, solver: str, threads: int | None,
        time_limit_s: float | None = None,
    ) -> tuple[tuple[np.ndarray, np.ndarray] | None, float | None]:
        """A feasible (y, r) from the LP relaxation (round y, fix it, re-solve the LP over the ratios), and the
        LP relaxation's objective (a lower bound of the MILP's)."""
        if self.num_candidates == 0:
            return None, None
        solver = lp_solver(solver)
        left = limits.remaining()  # what the call's budget has left for the local descent after the first plan
        with lifted():  # LPs only: the first plan comes even from a spent time budget
            return self._heuristic(model, idx, budget, solver, threads, time_limit_s, left)

    def _heuristic(
        self, model: MilpModel, idx: _Index, budget: float, solver: str, threads: int | None,
        time_limit_s: float | None, left: float | None = None,
    ) -> tuple[tuple[np.ndarray, np.ndarray] | None, float | None]:
        t0 = time.perf_counter()
        lp = relaxed(model)
        res = solve_model(lp, solver, threads=threads)
        if res.x is None:
            return None, None
        lp_bound = res.objective
        yl = np.array([res.x[j] for j in idx.y])
        best: tuple[float, np.ndarray, np.ndarray] | None = None
        quick = 2.0 if time_limit_s is None else min(2.0, 0.25 * time_limit_s)

        def units() -> Iterator[np.ndarray]:
            # Candidate roundings: thresholds on the LP's y; resolve nesting conflicts keeping the larger y.
            for thr in (1e-6, 0.25, 0.5, 0.75):
                if best is not None and left is not None and time.perf_counter() - t0 >= left:
                    return  # a plan in hand and the call's budget spent: no more LPs over the whole model
                yield self._unnest((yl > thr).astype(float), yl)
            if best is None:  # none fits (the LP spread y over nested chains): the units of a min-peak plan
                try:  # a first plan is worth a short overrun of a tiny limit (like the LPs above)
                    yield _min_peak(self, solver, threads, time_limit_s=min(2.0, max(quick, _FIRST_PLAN_S)))[1]
                except SolverError:
                    return

        for y in units():
            if not y.any():
                continue
            fixed = _fix_y(model, idx, y)
            sub = solve_model(fixed, solver, threads=threads)
            if sub.x is None:
                continue
            y2, r2 = self.decision_from(idx, sub.x)
            if idx.w:
                r2 = self._round_up(idx, sub.x, y2)
            # drop checkpoints the LP left unused: r = 0 only costs the intercept and adds recompute extras
            y2[r2 <= 1e-12] = 0.0
            r2 = self.repair(y2, r2 * y2, budget)
            if r2 is None:
                continue
            val = self.cost(y2, r2)
            if best is None or val < best[0] - 1e-12:
                best = (val, y2, r2)
        if best is None:
            return None, lp_bound
        if self.exact:
            limit = quick if left is None else min(quick, 0.25 * max(0.0, left - (time.perf_counter() - t0)))
            return self.improve(best[1], best[2], budget, time_limit_s=limit), lp_bound
        return (best[1], best[2]), lp_bound

    def _round_up(self, idx: _Index, x: Sequence[float], y: np.ndarray) -> np.ndarray:
        """Exact-mode ratios from a fractional LP solution ``x`` (with ``y`` fixed) that discard at least as much
        as the LP at every event, so the rounding stays feasible at nearly the LP's cost.

        A module alone takes the next option at or above its LP level. In a class of identical sequential
        blocks, the LP's fractional counts per level ``N_k = Σ w_{i,k}`` (over checkpointed members) are
        rounded up and given to the earliest members in forward order: every prefix of the forward order —
        what any fw or bw event counts — then discards ``Σ_k Δr_k · min(p, ⌈N_k⌉)``, at least the LP's, and
        only one member per level and class pays for the rounding."""
        r = np.zeros(self.num_candidates)
        done: set[int] = set()
        for _, members in self.classes():
            if len(members) < 2 or members[0] not in idx.w:
                continue
            seq = self._sequential(members)
            if seq is None:
                continue
            on = [s for s in seq if y[s] > 0.5]
            o = self.options(members[0])
            assert o is not None
            counts = [math.ceil(sum(x[idx.w[s][k]] for s in on) - 1e-6) for k in range(len(idx.w[members[0]]))]
            for i, s in enumerate(on):
                r[s] = o.ratio[sum(1 for n in counts if i < n)]
            done.update(members)
        for c in self.candidates:
            s = c.slot
            if s in done or y[s] < 0.5:
                continue
            o = self.options(s)
            if o is None or s not in idx.w:
                r[s] = min(1.0, max(0.0, x[idx.r[s]]))
            else:
                r[s] = o.ratio[sum(1 for j in idx.w[s] if x[j] > 1e-6)]
        return r

    def linear_terms(self) -> tuple[np.ndarray, np.ndarray]:
        """``(C, Y)`` with ``peaks(y, r) == ev_base - C @ r + Y @ y`` for 0/1 ``y`` (events × candidates, bytes),
        less the option-dependent :meth:`surge` at rc events (none where ``ev_surge`` is -1 everywhere).

        ``C[e, s]`` = bytes of slot ``s``'s calls that event ``e`` counts as discarded; ``Y[e, s]`` = what
        checkpointing ``s`` adds at ``e`` (its per-call overhead from its forward to the end of its backward, its
        recompute transient at its rc events). Memoised."""
        if getattr(self, "_lin", None) is None:
            n, nc = len(self.ev_base), self.num_candidates
            C = np.zeros((n, nc))
            Y = np.zeros((n, nc))
            fw_c = np.zeros((len(self.fw_slot) + 1, nc))  # per kc: discard coefficients of the first kc entries
            fw_y = np.zeros((len(self.fw_slot) + 1, nc))
            for p, (sl, a) in enumerate(zip(self.fw_slot, self.fw_amt)):
                fw_c[p + 1], fw_y[p + 1] = fw_c[p], fw_y[p]
                fw_c[p + 1, sl] += a
                fw_y[p + 1, sl] += self.fw_over[p]
            nb = len(self.bw_slot)
            bw_c = np.zeros((nb + 1, nc))  # per kc: coefficients of entries kc.. (not yet re-materialised)
            bw_y = np.zeros((nb + 1, nc))
            for p in range(nb - 1, -1, -1):
                bw_c[p], bw_y[p] = bw_c[p + 1], bw_y[p + 1]
                bw_c[p, self.bw_slot[p]] += self.bw_amt[p]
                bw_y[p, self.bw_slot[p]] += self.bw_over[p]
            for e in range(n):
                ph = self.ev_phase[e]
                if ph == FW:
                    kc = int(self.kc_fw[self.ev_k[e]])
                    C[e], Y[e] = fw_c[kc], fw_y[kc]
                elif ph in (BW, RC):
                    kc = int(self.kc_bw[self.ev_k[e]])
                    C[e], Y[e] = bw_c[kc], bw_y[kc]
            if len(self.t_ev):
                np.add.at(Y, (self.t_ev, self.t_slot), self.t_coef)
            self._lin = (C, Y)
        return self._lin

    def improve(
        self, y: np.ndarray, r: np.ndarray, budget: float, time_limit_s: float = 2.0
    ) -> tuple[np.ndarray, np.ndarray]:
        """Local descent over option levels of a feasible exact-mode decision (a better incumbent).

        Moves, best saving first, each checked exactly in bytes: a checkpointed module one option cheaper, or
        not checkpointed at all; and where that alone does not fit, one to three options cheaper for it with as
        many options more for another checkpointed module as that needs, when the pair saves time. Stops when
        no move saves or after ``time_limit_s``. Each check is a matrix-vector step on :meth:`linear_terms`.
        """
        t0 = time.perf_counter()
        C, Y = self.linear_terms()
        if np.any(self.ev_surge >= 0):  # each move checked against the largest surge its slot can add: safe
            Y = Y.copy()
            for i in np.nonzero(self.ev_surge >= 0)[0]:
                Y[i, int(self.ev_surge[i])] += max(self.surge(int(self.ev_surge[i])))
        nc = self.num_candidates
        opts = [self.options(s) for s in range(nc)]
        if any(o is None for o in opts) or nc == 0:
            return y, r
        w = np.array([c.calls * c.recompute_ms for c in self.candidates])
        y = (np.asarray(y, dtype=float) > 0.5).astype(float)
        lvl = np.array([opts[s].level_for(float(r[s])) if y[s] > 0.5 else -1 for s in range(nc)])
        ratio = lambda s, k: 0.0 if k < 0 else opts[s].ratio[k]  # noqa: E731
        qcost = lambda s, k: 0.0 if k < 0 else w[s] * opts[s].frac[k]  # noqa: E731
        ratios_of = [np.asarray(o.ratio) for o in opts]
        r = np.array([ratio(s, lvl[s]) for s in range(nc)])
        m = self.ev_base - C @ r + Y @ y
        lim = budget + 1e-6
        if np.max(m) > lim:
            return y, r
        while time.perf_counter() - t0 < time_limit_s:
            on = np.nonzero(lvl >= 0)[0]
            if not len(on):
                break
            # single moves: one level down (or off from level 0), or off from any level
            down = np.array([lvl[s] - 1 for s in on])
            d_r = np.array([ratio(s, k) - r[s] for s, k in zip(on, down)])
            d_y = np.where(down < 0, -1.0, 0.0)
            save = np.array([qcost(s, lvl[s]) - qcost(s, k) for s, k in zip(on, down)])
            new = m[:, None] - C[:, on] * d_r[None, :] + Y[:, on] * d_y[None, :]
            ok = np.max(new, axis=0) <= lim
            off_save = np.array([qcost(s, lvl[s]) for s in on])
            off_new = m[:, None] + C[:, on] * r[on][None, :] - Y[:, on]
            off_ok = np.max(off_new, axis=0) <= lim
            best_s, best_val, best_k = -1, 1e-12, 0
            for i, s in enumerate(on):
                if ok[i] and save[i] > best_val:
                    best_s, best_val, best_k = s, save[i], down[i]
                if off_ok[i] and off_save[i] > best_val:
                    best_s, best_val, best_k = s, off_save[i], -1
            if best_s >= 0:
                s = best_s
                nr, ny = ratio(s, best_k), (1.0 if best_k >= 0 else 0.0)
                m = m - C[:, s] * (nr - r[s]) + Y[:, s] * (ny - y[s])
                r[s], y[s], lvl[s] = nr, ny, best_k
                continue
            # pair moves: s one to three levels down, t (checkpointed) up by as many levels as that needs
            moved = False
            best = (1e-9, -1, -1, -1, -1)  # gain, s, s level, t, t level
            for s_ in on[np.argsort(-save)]:
                for k in range(lvl[s_] - 1, max(-1, lvl[s_] - 4), -1):
                    gain_s = qcost(s_, lvl[s_]) - qcost(s_, k)
                    if gain_s <= best[0]:
                        continue
                    excess = m - C[:, s_] * (ratio(s_, k) - r[s_]) - lim
                    bind = np.nonzero(excess > 0)[0]
                    if not len(bind):
                        continue  # a single move, taken above when it saved most
                    ts = on[on != s_]
                    cb = C[np.ix_(bind, ts)]
                    with np.errstate(divide="ignore", invalid="ignore"):
                        need = np.where(cb > 0, excess[bind][:, None] / cb, np.inf).max(axis=0)  # Δr per t
                    for t, dr in zip(ts, need):
                        if not np.isfinite(dr):
                            continue
                        kt = int(np.searchsorted(ratios_of[t], r[t] + dr - 1e-12))
                        if kt >= len(ratios_of[t]):
                            continue
                        gain = gain_s - (qcost(t, kt) - qcost(t, lvl[t]))
                        if gain > best[0]:
                            best = (gain, int(s_), k, int(t), kt)
            if best[1] >= 0:
                _, s_, k, t, kt = best
                moves = ((s_, k), (t, kt))
                m2 = m - sum(C[:, u] * (ratio(u, kk) - r[u]) for u, kk in moves)
                moved = bool(np.max(m2) <= lim)  # exact re-check of the pair
                if moved:
                    m = m2
                    for u, kk in moves:
                        r[u], lvl[u] = ratio(u, kk), kk
            if not moved:
                break
        return y, r

    def _unnest(self, y: np.ndarray, score: np.ndarray) -> np.ndarray:
        """Keep, along every candidate chain, only the outermost flagged node (its flagged descendants are
        dropped; ``score`` only orders the walk)."""
        y = y.copy()
        order = sorted(range(self.num_candidates), key=lambda s: (-score[s], s))
        for s in order:
            if y[s] < 0.5:
                continue
            p = self.candidates[s].parent_slot
            while p >= 0:
                if y[p] > 0.5:
                    y[s] = 0.0
                    break
                p = self.candidates[p].parent_slot
            if y[s] > 0.5:  # clear chosen descendants: slots are in pre-order, so they follow s contiguously
                end = self.tree.nodes[self.candidates[s].node].subtree_end
                t = s + 1
                while t < self.num_candidates and self.candidates[t].node < end:
                    y[t] = 0.0
                    t += 1
        return y



def _fix_y(model: MilpModel, idx: _Index, y: np.ndarray) -> MilpModel:
    return relaxed_with_fixed(model, {j: float(y[s]) for s, j in enumerate(idx.y)})


# -----------------------------------------------------------------------------------------------------------
# public entry points
# -----------------------------------------------------------------------------------------------------------
def baseline_peak(tree: ModuleTree, world_size: int | None = None) -> Bytes:
    """Predicted per-rank peak bytes without checkpointing (``max_e peak_e - S_e``), rounded up; a
    :class:`~sacplan.units.Bytes`, so it is read as bytes when passed back as a budget."""
    return Bytes(math.ceil(SacProblem(tree, world_size).baseline_peak() - 1e-6))


def _min_peak(
    problem: SacProblem, solver: str, threads: int | None, time_limit_s: float | None = None
) -> tuple[int, np.ndarray, np.ndarray, SolveResult, float]:
    """Solve the min-peak MILP; returns (ceil of the exact peak of its solution, y, r, result, build_s)."""
    t0 = time.perf_counter()
    model, idx = problem.build_min_peak()
    nc = problem.num_candidates
    warm = problem.columns_for(model, idx, np.zeros(nc), np.zeros(nc))
    build_s = time.perf_counter() - t0
    res = solve_model(model, solver, time_limit_s=time_limit_s, gap_rel=1e-9, gap_abs=1e-9, threads=threads, warm_start=warm)
    if res.x is None:
        raise SolverError(f"the min-peak MILP returned no solution ({res.solver}: {res.raw_status})")
    y, _ = problem.decision_from(idx, res.x)
    # Every event only falls as a ratio grows, so for the chosen units r = 1 is optimal: the peak depends on
    # the integer choice alone and is evaluated exactly (no solver tolerance in the reported minimum).
    r = y.copy()
    peak = problem.peak(y, r)
    return int(math.ceil(peak - 1e-6)), y, r, res, build_s


def min_feasible_budget(
    tree: ModuleTree,
    *,
    world_size: int | None = None,
    ac_units: Sequence[str] | None = None,
    fsdp_units: Sequence[str] | None = None,
    solver: str = "auto",
    threads: int | None = None,
    time_limit_s: float | None = DEFAULT_SOLVE_S,
) -> Bytes:
    """Smallest budget (bytes) any plan meets: the optimum of the MILP minimising the predicted peak.

    A :class:`~sacplan.units.Bytes`: pass it straight back as ``solve(tree, min_feasible_budget(tree))``,
    read as bytes even for a small model whose minimum is under 1 MiB.

    ``time_limit_s`` (s, default 60; None: none) bounds the call; stopped there, the peak of the best plan found
    is returned (a budget some plan meets, not proven the smallest)."""
    solver = check_solver(solver)
    limit = check_time_limit(time_limit_s)
    with deadline(limit):
        problem = SacProblem(tree, world_size, ac_units, fsdp_units)
        return Bytes(_min_peak(problem, solver, threads)[0])


def recompute_lower_bound(
    tree: ModuleTree,
    budget: int | float | str,
    *,
    world_size: int | None = None,
    ac_units: Sequence[str] | None = None,
    fsdp_units: Sequence[str] | None = None,
    solver: str = "auto",
    threads: int | None = None,
    time_limit_s: float | None = DEFAULT_SOLVE_S,
) -> float:
    """A recompute time (ms) that *no* plan fitting ``budget`` can beat, under sacplan's memory model.

    "Any plan" means any set of non-nested checkpoint units among the candidates, each with any op save
    list. Each module's cost is replaced by the LP relaxation of its op-level knapsack (see
    :func:`~sacplan.solve.ops.fractional_lines`: below every achievable option), and the resulting convex
    MILP is solved; its proven lower bound is returned. Comparing a plan's ``recompute_ms`` with this tells
    how far from the best possible plan it can at most be, e.g. whether a target ("a third of full
    checkpointing") is reachable at all. 0.0 when no checkpointing is needed. Stopped by ``time_limit_s`` before
    the search has a bound of its own, the bound of the MILP's LP relaxation is returned (weaker, still valid).

    Raises:
        InfeasibleBudgetError: no plan fits (with the smallest feasible budget).
    """
    solver = check_solver(solver)
    limit = check_time_limit(time_limit_s)
    with deadline(limit):
        return _recompute_lower_bound(tree, budget, world_size, ac_units, fsdp_units, solver, threads, limit)


def _recompute_lower_bound(
    tree: ModuleTree, budget: int | float | str, world_size: int | None, ac_units: Sequence[str] | None,
    fsdp_units: Sequence[str] | None, solver: str, threads: int | None, time_limit_s: float | None,
) -> float:
    problem = SacProblem(tree, world_size, ac_units, fsdp_units, relax=True)
    budget_bytes = parse_budget(budget, capacity_bytes=tree.stats.device.memory_bytes)
    if problem.baseline_peak() <= budget_bytes:
        return 0.0

    def infeasible() -> InfeasibleBudgetError:
        return InfeasibleBudgetError(budget_bytes, _min_peak(SacProblem(tree, world_size, ac_units, fsdp_units), solver, threads)[0])

    if problem.num_candidates == 0 or problem.lower_bound_peak() > budget_bytes:
        raise infeasible()
    model, idx, trivially_infeasible = problem.build(float(budget_bytes))
    if trivially_infeasible:
        raise infeasible()
    res = solve_model(model, solver, time_limit_s=time_limit_s, gap_rel=1e-6, gap_abs=1e-9, threads=threads,
                      priorities={k: 1 for k in idx.K} or None, options=["preprocess off"])  # see _solve_budget_model
    if res.status == INFEASIBLE:
        raise infeasible()
    if not math.isfinite(res.bound):  # stopped before its root bound: the LP relaxation's, weaker but valid
        with lifted():  # one LP: a bound even from a spent budget
            lp = solve_model(relaxed(model), lp_solver(solver), threads=threads)
        if lp.status == INFEASIBLE:
            raise infeasible()
        if lp.status != OPTIMAL:
            raise SolverError(f"{solver} proved no lower bound ({res.raw_status}); raise time_limit_s")
        return max(0.0, float(lp.objective))
    return max(0.0, float(res.bound))


def solve(
    tree: ModuleTree,
    budget: int | float | str,
    *,
    world_size: int | None = None,
    ac_units: list[str] | None = None,
    fsdp_units: list[str] | None = None,
    solver: str = "auto",
    time_limit_s: float | None = DEFAULT_SOLVE_S,
    gap_rel: float = 1e-4,
    op_level: bool = True,
    threads: int | None = None,
    exact: bool | None = None,
    max_options: int | None = 16,
    on_interrupt: str = "raise",
) -> Plan:
    r"""Cheapest selective activation checkpointing plan whose predicted per-rank peak fits ``budget``.

    Memory model
    ------------
    The tree comes from a collected step *without* checkpointing. For candidate module ``i`` with per-call
    discardable bytes ``A_{i,c}`` (``ModuleStats.act_bytes[c]``) the MILP chooses ``y_i ∈ {0,1}`` (checkpoint
    ``i``) and a discard fraction ``r_i ∈ [0, 1]`` with ``r_i ≤ y_i``; call ``c`` discards
    ``d_{i,c} = A_{i,c} · r_i``. With running sums over the step orders (the c-th occurrence of ``i`` in an
    order is call ``c``)::

        F_k = Σ_{first k entries of fw_post_order} d      (discarded by forwards that have finished)
        B_k = Σ_{first k entries of bw_pre_order}  d      (re-materialised: that module's backward began)
        D   = B_{len(bw_pre_order)}                       (all discards)
        S_e = state_bytes_e · (1 - stats.world_size / world_size)   (params/grads/optimizer state sharded)

    every timeline event ``e`` (``ModelStats.events``) predicts::

        fw    m_e = peak_e - S_e - F_{fw_done_e}
        bw    m_e = peak_e - S_e - (D - B_{bw_started_e})
        rc    m_e = peak_e - S_e - (D - B_{bw_started_e}) + extra_bytes_e · y_j
              (module j's backward start: recomputing a checkpointed j re-allocates its forward temporaries)
        other m_e = peak_e - S_e                            (loss, optimizer: unchanged by checkpointing)

    and the plan must satisfy ``m_e ≤ budget`` for all ``e``; the predicted peak is ``max_e m_e``.

    MILP
    ----
    minimise ``Σ_i calls_i · R_i · q_i`` (``R_i`` = ``tradeoff.full_recompute_ms``) subject to

    * ``q_i ≥ slope_s · r_i + intercept_s · y_i`` for every trade-off line ``s``, ``q_i ≥ 0`` (the
      perspective of the convex curve: exact at integer ``y`` and the tightest relaxation; no big-M);
    * ``r_i ≤ y_i``;
    * no nested checkpointing: ``u_i = u_{parent(i)} + y_i ≤ 1`` along candidate chains (``u`` = ``y`` at the
      top of a chain; a chain's last node needs no ``u`` column);
    * running sums as columns, only where a constraint needs them: ``F_{k'} = F_{k} + Σ_{entries k..k'} A·r/GiB``
      and ``G_k = D - B_k`` built from the end; an fw/bw event becomes the lower bound
      ``F_k ≥ (base_e - budget)/GiB`` (resp. ``G_k``) on one column, an rc event the row
      ``G_k - extra_e/GiB · y_j ≥ (base_e - budget)/GiB``.

    * ``K_c = Σ_{i ∈ c} y_i`` (integer) for each class ``c`` of ≥ 2 identical candidates (redundant, for
      branching; see below).

    Exact mode (``exact``, the default with ``op_level``): a candidate with an op list does not use trade-off
    lines. Its options come from :func:`~sacplan.solve.ops.module_options` — the module's exact Pareto front of
    save lists (a knapsack DP over its op groups), pruned to at most ``max_options`` — and it picks one of them:
    ``y_i`` selects option 0, ordered binaries ``w_{i,1} ≥ w_{i,2} ≥ …`` (``w_{i,1} ≤ y_i``) step up,
    ``r_i = r_0·y_i + Σ_k (r_k - r_{k-1})·w_{i,k}`` and the cost is ``R_i·(q_0·y_i + Σ_k (q_k - q_{k-1})·w_{i,k})``.
    The objective is then what the plan realises (the lines, an upper bound of the achievable staircase,
    were ~16% loose on a Llama block). For a class of identical sequential blocks, ``w_{j,k} ≤ w_{i,k} + 1 - y_i``
    for consecutive members ``i`` before ``j`` (see :meth:`SacProblem._sequential`: valid, it only removes
    symmetric copies), and counts ``N_{c,k} = Σ_{i∈c} w_{i,k}`` help the LP-branching proof.
    Each checkpointed call also keeps :func:`~sacplan.devices.checkpoint_state_bytes` (``o``; the RNG state
    checkpoint stashes, host-CPU targets only): the running sums use ``A·r - o·y``, and an rc event adds ``o``.
    :func:`recompute_lower_bound` bounds every plan from below (fractional knapsack per module).

    Events whose worst case fits the budget are dropped; among the rest, an event dominated by another
    (same or fewer discards, same or larger need) is dropped too, and trade-off lines never maximal on
    [0, 1] are dropped, so the model has ``3·|C| + |u| + |K| + |F| + |G|`` columns and
    ``|C| (r≤y) + Σ_i lines_i + (|C| - tops) + |K| + |F| + |G| + |rc|`` rows, with ``|F|, |G| ≤`` candidate
    calls + 1 and ``|rc| ≤`` candidate calls: linear in the model size. Bytes are in GiB, times in ms.

    Solving: an incumbent from the LP relaxation (round ``y``, re-solve the ratios) is handed to the solver,
    which proves optimality to ``gap_rel`` (no MILP search at all when the incumbent already meets the LP
    bounds after branching on the count columns below: a few in-process LPs).
    Identical candidates (repeated blocks) get a count column ``K = Σ_class y`` branched on first: the LP is
    weak only in *how many* blocks to checkpoint, and once that count is fixed its bound is nearly tight, so
    the symmetric search over *which* blocks never starts. (Auxiliary LPs and op-level knapsacks run on
    in-process HiGHS when highspy is installed.) Solutions are checked exactly in bytes and tiny tolerance
    violations repaired by raising ratios. With ``op_level`` each checkpointed module's ratio is realised by
    :func:`~sacplan.solve.ops.select_ops` (saving at most ``floor(A·(1-r))`` bytes), and the reported peak and
    recompute time are recomputed from the realised discards.

    Args:
        tree: the collected module tree.
        budget: per-rank memory budget: GiB number, bytes, ``"40GiB"``, ``"80%"`` of the target device...
            (:func:`sacplan.units.parse_budget`).
        world_size: ranks to plan for (None: as collected). State bytes scale by ``stats.world_size/world_size``.
        ac_units: only these modules may be checkpointed (None: every module with discardable activations,
            leaves included, except the root; the root too when named).
        fsdp_units: FSDP units; their ancestors are never checkpoint units.
        solver: ``"auto"`` (HiGHS when highspy is installed, else CBC), ``"cbc"`` (PuLP's bundled CBC) or
            ``"highs"`` (highspy).
        time_limit_s: wall-clock budget (s) of the whole call (default 60; None: no limit); when it runs out
            the best plan found is returned with ``status="time_limit"``, its proven ``gap`` and ``bound_ms``
            (and a one-line :class:`TimeLimitWarning`). <= 0 or NaN: :class:`ConfigError`.
        on_interrupt: Ctrl-C during the search: ``"raise"`` (KeyboardInterrupt) or ``"incumbent"`` (return the
            best plan so far, ``status="interrupted"``).
        gap_rel: relative optimality gap to prove.
        op_level: realise ratios with op-level selection (else ratio-only decisions).
        threads: solver threads (default 1: deterministic).
        exact: choose among exact op-level options (default: ``op_level``); False uses the trade-off lines
            and realises their ratios by op selection.
        max_options: options per module in exact mode (more: finer choice, larger MILP). None keeps each
            module's whole Pareto front of save lists: the MILP then ranges over *every* plan (any non-nested
            units, any save lists), and ``plan.meta["options_complete"]`` is True when no front had to be
            thinned — its proven optimum is the best plan there is under the memory model.

    Raises:
        InfeasibleBudgetError: no plan fits; carries the computed smallest feasible budget.
        ConfigError: unknown module names, world_size < 1, bad budget.
        SolverError: unknown/missing solver, or the solver failed.
    """
    solver = check_solver(solver)
    limit = check_time_limit(time_limit_s)
    if on_interrupt not in ("raise", "incumbent"):
        raise ConfigError(f"on_interrupt must be 'raise' or 'incumbent', got {on_interrupt!r}")
    with deadline(limit):
        return _solve(tree, budget, world_size, ac_units, fsdp_units, solver, limit, gap_rel, op_level, threads, exact,
                      max_options, on_interrupt)


def _solve(
    tree: ModuleTree, budget: int | float | str, world_size: int | None, ac_units: list[str] | None,
    fsdp_units: list[str] | None, solver: str, time_limit_s: float | None, gap_rel: float, op_level: bool,
    threads: int | None, exact: bool | None, max_options: int | None, on_interrupt: str,
) -> Plan:
    """:func:`solve` inside its time budget."""
    t_start = time.perf_counter()
    if exact is None:
        exact = op_level
    problem = SacProblem(tree, world_size, ac_units, fsdp_units, exact=exact and op_level, max_options=max_options, solver=solver)
    for note in problem.notes:
        warnings.warn(note, stacklevel=2)
    stats = tree.stats
    budget_bytes = parse_budget(budget, capacity_bytes=stats.device.memory_bytes)
    base_f = problem.baseline_peak()
    baseline = int(math.ceil(base_f - 1e-6))
    nc = problem.num_candidates
    common: dict[str, Any] = dict(
        budget_bytes=budget_bytes,
        baseline_peak_bytes=baseline,
        baseline_step_ms=float(stats.step_ms),
        world_size=problem.world_size,
        device_name=stats.device.name,
        model_name=stats.model_name,
        fingerprint=stats.fingerprint,
    )
    if base_f <= budget_bytes:
        zeros = np.zeros(nc)
        return Plan(
            decisions=(),
            predicted_peak_bytes=baseline,
            recompute_ms=0.0,
            status="not needed",
            objective_ms=0.0,
            bound_ms=0.0,
            gap=0.0,
            solver="",
            build_s=time.perf_counter() - t_start,
            solve_s=0.0,
            per_module_peak=_per_module_peak(problem, problem.peaks(zeros, zeros)),
            min_feasible_bytes=None,
            meta={"candidates": nc, "op_level": op_level, "baseline_peak_at": [stats.peak_phase, stats.peak_module]},
            **common,
        )

    def infeasible() -> InfeasibleBudgetError:
        mf, *_ = _min_peak(problem, solver, threads)
        return InfeasibleBudgetError(budget_bytes, mf)

    if nc == 0 or problem.lower_bound_peak() > budget_bytes:
        raise infeasible()
    model, idx, trivially_infeasible = problem.build(float(budget_bytes))
    if trivially_infeasible:
        raise infeasible()
    t_h = time.perf_counter()
    start, lp_bound = problem.heuristic(model, idx, float(budget_bytes), solver, threads, time_limit_s)
    heur_s = time.perf_counter() - t_h
    warm = problem.columns_for(model, idx, *start) if start is not None else None
    build_s = time.perf_counter() - t_start
    t_solve = time.perf_counter()
    remaining = None if time_limit_s is None else max(0.01, float(time_limit_s) - heur_s)
    counts = idx.K + [n for n, _, _ in idx.N]  # class counts: how many blocks checkpoint / reach each option
    try:
        res, cuts, by_lp = _solve_budget_model(
            problem, model, idx, warm, counts, float(budget_bytes), solver, gap_rel, lp_bound, remaining, threads
        )
    except SolveInterrupted as e:
        if on_interrupt != "incumbent":
            raise
        res, cuts, by_lp = interrupted_result(e.result, model, warm, solver), 0, False
    solve_s = time.perf_counter() - t_solve
    meta: dict[str, Any] = {
        "baseline_peak_at": [stats.peak_phase, stats.peak_module],
        "candidates": nc,
        "model": model.stats(),
        "events": len(problem.ev_base),
        "events_kept": idx.kept_events,
        "heuristic_s": heur_s,
        "heuristic_ms": None if start is None else problem.cost(*start),
        "raw_status": res.raw_status,
        "lp_bound_ms": lp_bound,
        # "lp": the incumbent met the LP bounds (after branching on count columns only); else the MILP solver
        "proved_by": "lp" if by_lp else solver,
        # solutions the solver accepted within its tolerance that exceed the budget in exact bytes, cut off
        "tolerance_cuts": cuts,
        "op_level": op_level,
        "exact": problem.exact,
        # every candidate chose among its whole Pareto front: the optimum is over every plan (max_options=None)
        "options_complete": problem.options_complete(),
    }
    min_feasible: int | None = None
    if res.x is None:
        if res.status == INFEASIBLE:
            mf, y_mp, r_mp, _, _ = _min_peak(problem, solver, threads)
            if mf > budget_bytes:
                raise InfeasibleBudgetError(budget_bytes, mf)
            # solver tolerance at the very edge: the min-peak solution fits exactly
            y, r = y_mp, r_mp
            objective, bound, gap, status = problem.cost(y, r), -math.inf, math.inf, TIME_LIMIT
            meta["fallback"] = "min-peak solution (the budget MILP was declared infeasible at the feasibility edge)"
            min_feasible = mf
        elif res.status == TIME_LIMIT:
            raise SolverError(
                f"{solver} hit the time limit ({time_limit_s} s) before finding any plan; raise time_limit_s "
                "(CLI: --time-limit)"
            )
        else:
            raise SolverError(f"{solver} failed on the SAC MILP: {res.raw_status}")
    else:
        y, r = problem.decision_from(idx, res.x)
        objective, bound, gap, status = res.objective, res.bound, res.gap, res.status
        if lp_bound is not None and math.isfinite(lp_bound) and not bound >= lp_bound:
            # stopped before the search had its own bound: the root LP relaxation bounds every plan
            bound = min(objective, lp_bound)
            gap = relative_gap(objective, bound)
        slack = problem.options_slack_ms()
        if slack > 0:  # options built past the time budget: bound the exact options' plans too, not proven
            meta["options_slack_ms"] = slack
            bound = bound - slack
            gap = relative_gap(objective, bound)
            status = TIME_LIMIT if status == OPTIMAL else status
    r_fixed = problem.repair(y, r, float(budget_bytes))
    if r_fixed is None:
        mf, y_mp, r_mp, _, _ = _min_peak(problem, solver, threads)
        if mf > budget_bytes:
            raise InfeasibleBudgetError(budget_bytes, mf)
        y, r = y_mp, r_mp
        meta["fallback"] = "min-peak solution (the solver's plan violated the budget beyond repair)"
        min_feasible = mf
    else:
        r = r_fixed
    r = problem.snap(y, r)  # exact mode: repaired ratios up to the next option (discards only grow)
    # a checkpoint that discards nothing only adds its recompute transient: drop it (every event falls or stays)
    y = np.where(r <= 1e-12, 0.0, y)
    r = r * y
    if status == TIME_LIMIT and math.isfinite(objective):  # unproven: state what the plan returned costs (a repair
        objective = max(objective, problem.cost(y, r))  # above may have raised it past the solver's objective)
        gap = relative_gap(objective, bound)
    if not problem.nesting_ok(y):  # pragma: no cover - guaranteed by the constraints
        raise SolverError("internal error: the solver returned nested checkpoint units")
    meta["model_recompute_ms"] = problem.cost(y, r)
    decisions, y_real, r_real = _realise(problem, y, r, op_level, solver)
    m = problem.peaks(y_real, r_real)
    predicted = int(math.ceil(float(np.max(m)) - 1e-6))
    if predicted > budget_bytes:  # pragma: no cover - realised discards only ever grow
        raise SolverError(f"internal error: realised plan peaks at {predicted} > budget {budget_bytes}")
    if status == TIME_LIMIT:
        warnings.warn(time_limit_message(time_limit_s, objective, bound, gap), TimeLimitWarning, stacklevel=3)
    return Plan(
        decisions=tuple(decisions),
        predicted_peak_bytes=predicted,
        recompute_ms=float(sum(d.recompute_ms for d in decisions)),
        status=status,
        objective_ms=float(objective),
        bound_ms=float(bound),
        gap=float(gap),
        solver=solver,
        build_s=build_s,
        solve_s=solve_s,
        per_module_peak=_per_module_peak(problem, m),
        min_feasible_bytes=min_feasible,
        meta=meta,
        **common,
    )


#: rounds of :func:`_solve_budget_model` before it hands over to ratio repair
_MAX_CUTS = 32


def _solve_budget_model(
    problem: SacProblem,
    model: MilpModel,
    idx: _Index,
    warm: list[float] | None,
    counts: list[int],
    budget: float,
    solver: str,
    gap_rel: float,
    lp_bound: float | None,
    time_limit_s: float | None,
    threads: int | None,
) -> tuple[SolveResult, int, bool]:
    """Solve the budget MILP; in exact mode, also to exactness in bytes.

    Returns (result, cuts added, whether the LP bounds alone proved it: :func:`prove_by_lp_branching`).

    A solver accepts rows violated by up to its feasibility tolerance (~1e-9 GiB, about a byte here), so at a
    budget met with equality it may return a plan a few bytes over. In exact mode every column is fixed by
    the binary columns (``y``, option levels ``w``), so such a solution is removed exactly by a no-good cut
    over them — ``Σ_{x_j=0} x_j + Σ_{x_j=1} (1 - x_j) ≥ 1`` — which excludes that one assignment and no
    other, and the model is solved again: the optimum over exactly feasible plans, proven. (Repairing the
    ratio of some checkpointed module instead, as the lines mode does, is not optimal in exact mode: it jumps
    to a dearer option, or to the min-peak fallback when nothing was checkpointed.) CBC runs with
    preprocessing off: on budgets met with equality its preprocessing has cut off the optimum (a 3-module
    tree: 25.912 ms "optimal" against 22.994 ms with it off, and by brute force).
    """
    binaries = (idx.y + [j for cols in idx.w.values() for j in cols]) if problem.exact else []
    cuts = 0
    t0 = time.perf_counter()
    while True:
        remaining = None if time_limit_s is None else max(0.01, time_limit_s - (time.perf_counter() - t0))
        proven = prove_by_lp_branching(
            model, warm, counts, gap_rel=gap_rel, lp_solver=lp_solver(solver), root_bound=lp_bound if not cuts else None,
            solver_name=solver,
        )
        res = proven or solve_model(
            model,
            solver,
            time_limit_s=remaining,
            gap_rel=gap_rel,
            gap_abs=1e-7,
            threads=threads,
            warm_start=warm,
            # branch on class counts first (CBC's preprocessing would substitute the count columns away), then
            # on how many members of a class reach each option level: llama-small x48 at 0.5 GiB, gap 5.8e-4
            # after 500 s without the level counts, proven in ~15 s with them (issue 14)
            priorities={**{k: 1 for k in idx.K}, **{n: 2 for n, _, _ in idx.N}} or None,
            options=["preprocess off"],
        )
        if res.x is None or not binaries or cuts >= _MAX_CUTS:
            return res, cuts, proven is not None
        y, r = problem.decision_from(idx, res.x)
        if math.ceil(problem.peak(y, problem.snap(y, r)) - 1e-6) <= budget:
            return res, cuts, proven is not None
        if limits.expired():  # no time for another round: :func:`_solve` repairs the few bytes over, unproven
            if res.status == OPTIMAL:
                res = dataclasses.replace(res, status=TIME_LIMIT)
            return res, cuts, False
        ones = [j for j in binaries if res.x[j] > 0.5]
        zeros = [j for j in binaries if res.x[j] <= 0.5]
        model.add_row(f"cut{cuts}", zeros + ones, [1.0] * len(zeros) + [-1.0] * len(ones), lb=1.0 - len(ones))
        cuts += 1


def _per_module_peak(problem: SacProblem, m: np.ndarray) -> dict[str, int]:
    out: dict[str, float] = {}
    for mod, v in zip(problem.ev_module, m):
        if v > out.get(mod, -math.inf):
            out[mod] = float(v)
    return {k: int(math.ceil(v - 1e-6)) for k, v in sorted(out.items())}


def _realise(
    problem: SacProblem, y: np.ndarray, r: np.ndarray, op_level: bool, solver: str
) -> tuple[list[ModuleDecision], np.ndarray, np.ndarray]:
    """Module decisions with op-level selection; returns them and the realised (y, r).

    A ratio of 1 saves only ops that cost no bytes (an op making the module's output, kept anyway), or is a
    plain full checkpoint when there are none (a full checkpoint recomputes them too). Otherwise the ops saved hold at
    most ``floor(A·(1 - r))`` bytes, so the realised discard ``A - saved`` is at least ``A·r`` and every
    event's prediction can only fall. When the ops that must be saved (in-place inputs, random ops) do not
    fit, the module falls back to a full checkpoint (discards everything; costs the full recompute).
    """
    decisions = []
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
                    saved_ops=None,
                    calls=c.calls,
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
                    recompute_flops=int(round(c.calls * t.full_recompute_flops * _q(c, float(r_real[s])))),
                    saved_ops=None,
                    calls=c.calls,
                )
            )
    return decisions, y, r_real


def _q(c: Candidate, r: float) -> float:
    return max([0.0] + [s * r + b for s, b in zip(c.slopes, c.intercepts)])
