"""The MILP formulation over a :class:`SacProblem` of the memory model :mod:`sacplan.timeline`: the budget model
(:func:`build_budget_model`: least recompute ms, every kept event under the budget) and the min-peak model
(:func:`build_min_peak_model`: its optimum is the smallest feasible budget), each with a :class:`MilpIndex` of its
columns; a decision ``(y, r)`` as a column vector (:func:`columns_for`) and back (:func:`decision_from`).

The model
---------
For candidate ``i`` (checkpoint flag ``y_i``, discard ratio ``r_i``, per-call discardable bytes ``A_{i,c}``;
call ``c`` discards ``A_{i,c}·r_i``) every event of :class:`~sacplan.timeline.Timeline` must stay within the
budget; minimise ``Σ_i calls_i · R_i · q_i`` (``R_i`` = ``tradeoff.full_recompute_ms``) subject to

* ``q_i ≥ slope_s · r_i + intercept_s · y_i`` for every trade-off line ``s``, ``q_i ≥ 0`` (the
  perspective of the convex curve: exact at integer ``y`` and the tightest relaxation; no big-M);
* ``r_i ≤ y_i``;
* no nested checkpointing: ``u_i = u_{parent(i)} + y_i ≤ 1`` along candidate chains (``u`` = ``y`` at the
  top of a chain; a chain's last node needs no ``u`` column);
* running sums as columns, only where a constraint needs them: ``F_{k'} = F_{k} + Σ_{entries k..k'} A·r/GiB``
  and ``G_k = D - B_k`` built from the end; an fw/bw event becomes the lower bound
  ``F_k ≥ (base_e - budget)/GiB`` (resp. ``G_k``) on one column, an rc event the row
  ``G_k - extra_e/GiB · y_j ≥ (base_e - budget)/GiB``; an interleaved event (a pipeline stage's schedule:
  :attr:`~sacplan.timeline.Timeline.mixed`) the row ``F_kf + G_kb - G_0 - added ≥ (base_e - budget)/GiB``;
* ``K_c = Σ_{i ∈ c} y_i`` (integer) for each class ``c`` of ≥ 2 identical candidates (redundant: branched on
  first, see :mod:`sacplan.solver.count_branching`).

Exact mode (``exact``, the default with ``op_level``): a candidate with an op list picks one of its options
(:func:`~sacplan.solver.ops.module_options`: its exact Pareto front of save lists, at most ``max_options``):
``y_i`` selects option 0, ordered binaries ``w_{i,1} ≥ w_{i,2} ≥ …`` (``w_{i,1} ≤ y_i``) step up,
``r_i = r_0·y_i + Σ_k (r_k - r_{k-1})·w_{i,k}`` and the cost is ``R_i·(q_0·y_i + Σ_k (q_k - q_{k-1})·w_{i,k})``.
The objective is then what the plan realises (the lines were ~16% loose on a Llama block). For a class of identical
sequential blocks, ``w_{j,k} ≤ w_{i,k} + 1 - y_i`` for consecutive members ``i`` before ``j`` (valid: it only
removes symmetric copies, :meth:`~sacplan.solver.problem.SacProblem.sequential`), and counts ``N_{c,k} = Σ_{i∈c}
w_{i,k}`` help the LP-branching proof. Each checkpointed call also keeps ``o`` bytes
(:func:`~sacplan.devices.checkpoint_state_bytes`, the stashed RNG state; held inputs): the running sums use
``A·r - o·y``, and an rc event adds ``o`` and the RNG-state copy its recomputation holds
(:func:`~sacplan.evaluate.rng_copy_bytes`, part of ``extra_e``).

Events whose worst case fits the budget are dropped, and among the rest those another dominates (same or fewer
discards, same or larger need; :func:`_select_events`), so the model has ``3·|C| + |u| + |K| + |F| + |G|`` columns
and ``|C| (r≤y) + Σ_i lines_i + (|C| - tops) + |K| + |F| + |G| + |rc|`` rows, ``|F|, |G| ≤`` candidate calls + 1,
``|rc| ≤`` candidate calls: linear in the model size. Bytes are in GiB, times in ms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from sacplan.solver.model import MilpModel, relaxed
from sacplan.solver.problem import SacProblem
from sacplan.timeline import BW, FW, OTHER, RC
from sacplan.units import GiB


@dataclass
class MilpIndex:
    """Column indices of one built model (which column holds each candidate's ``y``, ``r``, ...)."""

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


def build_budget_model(
    problem: SacProblem, budget: float, caps: Mapping[int, float] | None = None
) -> tuple[MilpModel, MilpIndex, bool]:
    """The budget MILP (minimise recompute ms). ``caps``: upper bounds (bytes) on the forward running sum ``F`` at
    these candidate-entry counts (the PyTorch Graph adapter's ``a_i ≥ 0``, :mod:`sacplan.solver.compat`).
    Returns (model, index, trivially_infeasible)."""
    model, idx, (fw, bw, rc, other, mixed), (Fcol, Gcol) = _event_model(problem, budget, caps or {})
    infeasible = other > 0 or any(kc == 0 and nd > 0 for kc, nd in fw) or any(
        kc == len(problem.bw_slot) and nd > 0 for kc, nd in bw
    )
    for j, (kc, terms, nd, ss) in enumerate(rc):
        ind, val = _added(problem, idx, terms, ss)
        model.add_row(f"rc{j}_{kc}", [Gcol[kc]] + ind, [1.0] + [-v for v in val], lb=nd / GiB)
    for j, (kf, kb, terms, nd, ss) in enumerate(mixed):
        ind, val = _mixed_row(problem, idx, Fcol, Gcol, kf, kb, terms, ss)
        model.add_row(f"mx{j}_{kf}_{kb}", ind, val, lb=nd / GiB)
    return model, idx, infeasible


def build_min_peak_model(problem: SacProblem) -> tuple[MilpModel, MilpIndex]:
    """The MILP minimising the predicted peak P (GiB) under the same structural constraints."""
    model, idx, (fw, bw, rc, _, mixed), (Fcol, Gcol) = _event_model(problem, None, {})
    for j, (kf, kb, terms, base, ss) in enumerate(mixed):
        ind, val = _mixed_row(problem, idx, Fcol, Gcol, kf, kb, terms, ss)
        model.add_row(f"pm{j}_{kf}_{kb}", ind + [idx.P], val + [1.0], lb=base / GiB)
    for kc, base in fw:
        model.add_row(f"pf{kc}", [Fcol[kc], idx.P], [1.0, 1.0], lb=base / GiB)
    for kc, base in bw:
        model.add_row(f"pb{kc}", [Gcol[kc], idx.P], [1.0, 1.0], lb=base / GiB)
    for j, (kc, terms, base, ss) in enumerate(rc):
        ind, val = _added(problem, idx, terms, ss)
        model.add_row(f"pr{j}_{kc}", [Gcol[kc], idx.P] + ind, [1.0, 1.0] + [-v for v in val], lb=base / GiB)
    return model, idx


def _event_model(
    problem: SacProblem, budget: float | None, caps: Mapping[int, float]
) -> tuple[MilpModel, MilpIndex, tuple, tuple]:
    """The columns both models share: the candidates' (:func:`_base_columns`; with costs at a ``budget``), the peak
    ``P`` (min-peak model, ``budget`` None) and the running sums the kept events read (``F`` also where ``caps``
    bound it, bytes). Returns the model, its index, the kept events ``(fw, bw, rc, other, mixed)`` (needs in bytes)
    and the running-sum columns."""
    fw, bw, rc, other, pruned = _select_events(problem, budget)
    mixed = _select_mixed(problem, budget)
    model = MilpModel(name="sacplan_sac" if budget is not None else "sacplan_minpeak")
    idx = MilpIndex(pruned_events=pruned - len(mixed), kept_events=len(fw) + len(bw) + len(rc) + len(mixed))
    _base_columns(problem, model, idx, with_cost=budget is not None)
    if budget is None:
        idx.P = model.add_col("P", max(0.0, other / GiB if other > -math.inf else 0.0), math.inf, False, 1.0)
    lbs = ({kc: nd / GiB for kc, nd in fw}, {kc: nd / GiB for kc, nd in bw}) if budget is not None else ({}, {})
    Fcol = _running_columns(problem, model, idx, "F", [kc for kc, _ in fw] + [kf for kf, *_ in mixed] + list(caps),
                           lbs[0], forward=True, ub={kc: v / GiB for kc, v in caps.items()})
    idx.F.extend(Fcol.items())
    Gcol = _running_columns(
        problem, model, idx, "G",
        [kc for kc, _ in bw] + [kc for kc, *_ in rc] + [kb for _, kb, *_ in mixed] + ([0] if mixed else []), lbs[1],
        forward=False, ub={})
    idx.G.extend(Gcol.items())
    return model, idx, (fw, bw, rc, other, mixed), (Fcol, Gcol)


def columns_for(
    problem: SacProblem, model: MilpModel, idx: MilpIndex, y: Sequence[float], r: Sequence[float]
) -> list[float]:
    """A full column vector for decision (y, r) (q, u, F, G, P filled in consistently)."""
    x = [0.0] * model.num_cols
    y = [1.0 if v > 0.5 else 0.0 for v in y]
    r = [float(min(1.0, max(0.0, rv))) * yv for rv, yv in zip(r, y)]
    if idx.w:
        r = [float(v) for v in problem.snap(y, r)]
        # The symmetry rows want, in a class of identical sequential blocks, the earlier checkpointed block
        # at the larger discard; sort the discards so (same cost, no event higher: see SacProblem.sequential). Else
        # the warm start violates them and the solver drops it.
        for _, members in problem.classes():
            seq = problem.sequential(members) if len(members) >= 2 and members[0] in idx.w else None
            on = [s for s in (seq or []) if y[s] > 0.5]
            for s, v in zip(on, sorted((r[s] for s in on), reverse=True)):
                r[s] = v
    for c in problem.candidates:
        s = c.slot
        x[idx.y[s]] = y[s]
        x[idx.r[s]] = r[s]
        if s in idx.q:
            x[idx.q[s]] = max([0.0] + [sl * r[s] + ic * y[s] for sl, ic in zip(c.slopes, c.intercepts)])
        if s in idx.w and y[s] > 0.5:
            o = problem.options(s)
            assert o is not None
            for k in range(o.level_for(r[s])):
                x[idx.w[s][k]] = 1.0
    for col, members, k in idx.N:
        x[col] = float(sum(x[idx.w[s][k]] for s in members))
    if idx.K:
        ks = [members for _, members in problem.classes() if len(members) >= 2]
        for col, members in zip(idx.K, ks):
            x[col] = float(sum(y[s] for s in members))
    for c in problem.candidates:  # pre-order: parents first
        if c.slot in idx.u:
            p = c.parent_slot
            up = x[idx.u[p]] if p in idx.u else y[p]
            x[idx.u[c.slot]] = up + y[c.slot]
    # the running-sum columns are the timeline's running sums, read where each candidate-entry count begins
    F, G = problem.timeline.running(*problem.call_freed(y, r))
    for kc, col in idx.F:
        x[col] = float(F[int(np.searchsorted(problem.kc_fw, kc))]) / GiB
    for kc, col in idx.G:
        x[col] = float(G[int(np.searchsorted(problem.kc_bw, kc))]) / GiB
    if idx.P >= 0:
        x[idx.P] = problem.peak(y, r) / GiB
    return x


def decision_from(problem: SacProblem, idx: MilpIndex, x: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """The decision (y, r) a column vector ``x`` of a model built here encodes (exact candidates: the ratio of
    the option its level columns reach)."""
    y = np.array([1.0 if x[j] > 0.5 else 0.0 for j in idx.y])
    r = np.array([min(1.0, max(0.0, x[j])) for j in idx.r]) * y
    for s, cols in idx.w.items():  # exact candidates: the option level from the level columns
        o = problem.options(s)
        if o is not None and y[s] > 0.5:
            r[s] = o.ratio[int(sum(1 for j in cols if x[j] > 0.5))]
    return y, r


def fix_y(model: MilpModel, idx: MilpIndex, y: np.ndarray) -> MilpModel:
    """The LP relaxation of ``model`` with every checkpoint flag fixed to ``y`` (the ratios left free)."""
    return relaxed(model, {j: float(y[s]) for s, j in enumerate(idx.y)})


#: an rc event's row: (kc, ((slot, bytes added), ...), need, surge slot); an interleaved event's: (kf, kb, ...)
Rc = tuple[int, tuple[tuple[int, float], ...], float, int]
Mixed = tuple[int, int, tuple[tuple[int, float], ...], float, int]


def _select_events(
    problem: SacProblem, budget: float | None
) -> tuple[list[tuple[int, float]], list[tuple[int, float]], list[Rc], float, int]:
    """The events left after pruning and dominance: ``fw`` [(kc, need)] kc ascending, ``bw`` [(kc, need)] kc
    descending, ``rc`` [(kc, ((slot, bytes added if checkpointed), ...), need, surge slot)] where checkpointing adds
    bytes (surge slot: whose option-dependent :meth:`SacProblem.surge` the event adds, else -1), the largest ``other``
    need, and the number dropped. ``need`` is ``base - budget`` (``base`` for the min-peak model, ``budget`` None)."""
    need = problem.ev_base - (0.0 if budget is None else float(budget))
    ph = np.where(problem.ev_mixed, -1, problem.ev_phase)  # interleaved events: _select_mixed
    other = float(np.max(need[ph == OTHER])) if np.any(ph == OTHER) else -math.inf
    # Dominance needs monotone running sums: d = A·r - o·y >= 0 for every call, which the rows r >= min_ratio·y of
    # :func:`_base_columns` guarantee (:attr:`~sacplan.solver.candidates.Candidate.min_ratio`). F (forward discards
    # so far) is non-decreasing in kc, G (discards not yet re-materialised) non-increasing: keep strictly
    # increasing needs along each.
    fw = _rising(need, ph == FW, problem.ev_k, problem.kc_fw, _slack(problem, budget), ascending=True)
    bw = _rising(need, ph == BW, problem.ev_k, problem.kc_bw, _slack(problem, budget), ascending=False)
    rc = [(k[0], terms, nd, k[2]) for k, terms, nd in _pareto_added(
        problem, budget, np.nonzero(ph == RC)[0], lambda i: (int(problem.kc_bw[problem.ev_k[i]]),))]
    kept = len(fw) + len(bw) + len(rc) + (1 if other > -math.inf else 0)
    return fw, bw, rc, other, len(need) - kept


def _slack(problem: SacProblem, budget: float | None) -> float:
    """What checkpointing's per-call overheads can add at most (bytes): events within it of the budget stay
    (``inf`` for the min-peak model, ``budget`` None: every event stays)."""
    if budget is None:
        return math.inf
    return max(float(problem.fw_over.sum()), float(problem.bw_over.sum()))


def _rising(
    need: np.ndarray, sel: np.ndarray, pos: np.ndarray, kcs: np.ndarray, slack: float, ascending: bool
) -> list[tuple[int, float]]:
    """The largest need per candidate-entry count ``kc = kcs[pos[event]]`` among the ``sel`` events that ``slack``
    could push over, then only the counts whose need rises strictly along ``kc`` (ascending, or descending)."""
    best: dict[int, float] = {}
    for i in np.nonzero(sel & (need + slack > 0))[0]:
        kc = int(kcs[pos[i]])
        if need[i] > best.get(kc, -math.inf):
            best[kc] = float(need[i])
    out, run = [], -math.inf
    for kc in sorted(best, reverse=not ascending):
        if best[kc] > run:
            out.append((kc, best[kc]))
            run = best[kc]
    return out


def _pareto_added(
    problem: SacProblem, budget: float | None, events: np.ndarray, kcs: Callable[[int], tuple[int, ...]]
) -> list[tuple[tuple, tuple[tuple[int, float], ...], float]]:
    """The ``events`` where checkpointing adds bytes that the worst case could push over the budget, grouped by
    ``(kcs(event), slots, surge slot)``: per group (sorted) the Pareto-maximal ``(need, added bytes)``, as
    ``(key, terms, need)`` with ``key = kcs(event) + (slots, surge slot)``."""
    need = problem.ev_base - (0.0 if budget is None else float(budget))
    slack, top = _slack(problem, budget), problem.surge_top()
    groups: dict[tuple, list[tuple[float, tuple[float, ...]]]] = {}
    for i in events:
        terms = problem.ev_terms[i]
        if budget is not None and need[i] + slack + sum(cf for _, cf in terms) + top[i] <= 0:
            continue
        key = kcs(i) + (tuple(sl for sl, _ in terms), int(problem.ev_surge[i]))
        groups.setdefault(key, []).append((float(need[i]), tuple(cf for _, cf in terms)))
    out = []
    for key in sorted(groups):
        kept: list[tuple[float, ...]] = []
        for nd, cfs in sorted(groups[key], key=lambda t: (-t[0], tuple(-c for c in t[1]))):
            if not any(all(a >= b for a, b in zip(k, cfs)) for k in kept):
                out.append((key, tuple(zip(key[-2], cfs)), nd))
                kept.append(cfs)
    return out


def _select_mixed(problem: SacProblem, budget: float | None) -> list[Mixed]:
    """The interleaved events' rows (:attr:`~sacplan.timeline.Timeline.mixed`, a pipeline stage's schedule) as
    ``(kf, kb, terms, need, surge slot)``, ``kf``/``kb`` the candidate-entry counts of both orders before the event,
    selected as the rc events of :func:`_select_events` are (:func:`_pareto_added`)."""
    return [(k[0], k[1], terms, nd, k[3]) for k, terms, nd in _pareto_added(
        problem, budget, np.nonzero(problem.ev_mixed)[0],
        lambda i: (int(problem.kc_fw[problem.ev_kf[i]]), int(problem.kc_bw[problem.ev_kb[i]])))]


def _mixed_row(
    problem: SacProblem, idx: MilpIndex, Fcol: dict[int, int], Gcol: dict[int, int], kf: int, kb: int,
    terms: Sequence[tuple[int, float]], ss: int,
) -> tuple[list[int], list[float]]:
    """Columns and coefficients of an interleaved event's freed bytes ``F_kf + G_kb - G_0`` less what checkpointing
    adds there (GiB)."""
    coef: dict[int, float] = {}
    for col, v in ((Fcol[kf], 1.0), (Gcol[kb], 1.0), (Gcol[0], -1.0)):
        coef[col] = coef.get(col, 0.0) + v
    ind, val = _added(problem, idx, terms, ss)
    for col, v in zip(ind, val):
        coef[col] = coef.get(col, 0.0) - v
    return list(coef), list(coef.values())


def _base_columns(problem: SacProblem, model: MilpModel, idx: MilpIndex, with_cost: bool) -> None:
    """Each candidate's ``y`` and ``r`` with ``r ≤ y`` and ``r ≥ min_ratio·y`` (a checkpointed call frees at least
    what it keeps, :attr:`~sacplan.solver.candidates.Candidate.min_ratio`), the nesting rows ``u_i = u_parent + y_i
    ≤ 1`` (``u`` is ``y`` at a chain's top; a chain's last candidate needs no ``u``) and, ``with_cost``, the costs
    (:func:`_cost_columns`)."""
    for c in problem.candidates:
        idx.y.append(model.add_col(f"y{c.slot}", 0.0, 1.0, True))
        idx.r.append(model.add_col(f"r{c.slot}", 0.0, 1.0))
    for c in problem.candidates:
        model.add_row(f"ry{c.slot}", [idx.r[c.slot], idx.y[c.slot]], [1.0, -1.0], ub=0.0)
        if c.min_ratio > 0:
            model.add_row(f"rmin{c.slot}", [idx.r[c.slot], idx.y[c.slot]], [1.0, -c.min_ratio], lb=0.0)
    for c in problem.candidates:  # pre-order: parents first
        s, p = c.slot, c.parent_slot
        if p < 0:
            continue
        up = idx.u.get(p, idx.y[p])
        if c.has_child:
            idx.u[s] = model.add_col(f"u{s}", 0.0, 1.0)
            model.add_row(f"nest{s}", [idx.u[s], up, idx.y[s]], [1.0, -1.0, -1.0], lb=0.0, ub=0.0)
        else:
            model.add_row(f"nest{s}", [up, idx.y[s]], [1.0, 1.0], ub=1.0)
    if with_cost:
        _cost_columns(problem, model, idx)


def _cost_columns(problem: SacProblem, model: MilpModel, idx: MilpIndex) -> None:
    """The class counts ``K``, each candidate's cost (exact options' level columns, or ``q`` over its trade-off
    lines), the level counts ``N`` and symmetry rows of exact classes."""
    for _, members in problem.classes():  # identical candidates (repeated blocks): how many are checkpointed
        if len(members) >= 2:
            idx.K.append(_count_column(model, "K", f"{members[0]}", [idx.y[s] for s in members]))
    for c in problem.candidates:
        s = c.slot
        w = c.calls * c.recompute_ms
        o = problem.options(s)
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
        for li, (sl, ic) in enumerate(zip(c.slopes, c.intercepts)):  # lines below 0 on [0, 1]: implied by q >= 0
            if not (sl <= 0 and ic <= 0):
                model.add_row(f"line{s}_{li}", [idx.q[s], idx.r[s], idx.y[s]], [1.0, -float(sl), -float(ic)], lb=0.0)
    for _, members in problem.classes():  # exact classes: how many members reach each option level
        if len(members) < 2 or members[0] not in idx.w:
            continue
        for k in range(len(idx.w[members[0]])):
            idx.N.append((_count_column(model, "N", f"{members[0]}_{k + 1}", [idx.w[s][k] for s in members]),
                          members, k))
        # Symmetry breaking (valid, see :meth:`SacProblem.sequential`): of two checkpointed members, the earlier one
        # (forward order) reaches every level the later one does: w_{j,k} <= w_{i,k} + 1 - y_i.
        seq = problem.sequential(members)
        if seq is not None:
            for i, j in zip(seq, seq[1:]):
                for k in range(len(idx.w[i])):
                    model.add_row(f"sym{i}_{j}_{k + 1}", [idx.w[j][k], idx.w[i][k], idx.y[i]], [1.0, -1.0, 1.0], ub=1.0)


def _count_column(model: MilpModel, kind: str, label: str, cols: Sequence[int]) -> int:
    """An integer column counting the 0/1 ``cols`` of a class of identical candidates (``K``: how many are
    checkpointed; ``N``: how many reach an option level): redundant, but branch-and-bound branches on *how many*
    instead of *which*, the source of the symmetric stall."""
    k = model.add_col(f"{kind}{label}", 0.0, float(len(cols)), True)
    model.add_row(f"{kind}def{label}", [k] + list(cols), [1.0] + [-1.0] * len(cols), lb=0.0, ub=0.0)
    return k


def _running_columns(
    problem: SacProblem, model: MilpModel, idx: MilpIndex, name: str, kcs: Sequence[int], lb: dict[int, float],
    forward: bool, ub: Mapping[int, float],
) -> dict[int, int]:
    """One running sum's columns ``S_kc = S_prev + Σ (A·r - o·y)/GiB`` over the candidate entries between:
    forward (``F``), entries ``< kc`` of ``fw_post_order`` with ``kc`` ascending; backward (``G``), entries
    ``>= kc`` of ``bw_pre_order`` with ``kc`` descending; bounded by ``lb`` and ``ub`` (GiB) where they name
    ``kc``. Returns ``{kc: column}`` in that order."""
    slot, amt, over = (problem.fw_slot, problem.fw_amt, problem.fw_over) if forward else (
        problem.bw_slot, problem.bw_amt, problem.bw_over)
    cols: dict[int, int] = {}
    prev_col, prev_kc = -1, (0 if forward else len(slot))
    for kc in sorted(set(kcs), reverse=not forward):
        col = model.add_col(f"{name}{kc}", lb.get(kc, -math.inf), ub.get(kc, math.inf))
        ind, val = [col], [1.0]
        if prev_col >= 0:
            ind.append(prev_col)
            val.append(-1.0)
        for p in (range(prev_kc, kc) if forward else range(kc, prev_kc)):
            ind.append(idx.r[int(slot[p])])
            val.append(-amt[p] / GiB)
            if over[p]:
                ind.append(idx.y[int(slot[p])])
                val.append(over[p] / GiB)
        model.add_row(f"{name}def{kc}", ind, val, lb=0.0, ub=0.0)
        cols[kc] = col
        prev_col, prev_kc = col, kc
    return cols


def _added(
    problem: SacProblem, idx: MilpIndex, terms: Sequence[tuple[int, float]], ss: int
) -> tuple[list[int], list[float]]:
    """Columns and GiB coefficients of what checkpointing adds at an rc event: ``terms`` on the ``y`` columns
    and, for the surge slot ``ss``, its option-dependent surge on its level columns (option 0 on ``y``:
    ``surge_0·y + Σ_k (surge_k - surge_{k-1})·w_k``, exact for the option the levels pick)."""
    coef = {idx.y[s]: cf / GiB for s, cf in terms}
    if ss >= 0 and ss in idx.w:
        sg = problem.surge(ss)
        coef[idx.y[ss]] = coef.get(idx.y[ss], 0.0) + sg[0] / GiB
        for k, col in enumerate(idx.w[ss], start=1):
            if sg[k] != sg[k - 1]:
                coef[col] = (sg[k] - sg[k - 1]) / GiB
    return list(coef), list(coef.values())
