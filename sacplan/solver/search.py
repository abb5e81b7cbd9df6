"""Plans without the budget MILP's search: the heuristic incumbent, exact-byte repair, the min-peak plan.

* :func:`heuristic` finds a good feasible incumbent for the budget MILP (LP relaxation, rounding of the
  checkpoint flags, LP re-solve over the ratios, in exact mode rounding of the option levels and a local
  descent, :func:`improve`) that the branch-and-bound starts from;
* :func:`repair` raises ratios until a decision fits the budget exactly in bytes (solver tolerances);
* :func:`solve_min_peak` solves the min-peak MILP: the smallest feasible budget and a plan that meets it.

Every decision is checked by the exact evaluation of :class:`~sacplan.solver.problem.SacProblem`.
"""

from __future__ import annotations

import math
import time
from typing import Iterator, Sequence

import numpy as np

from sacplan.errors import SolverError
from sacplan.solver import limits
from sacplan.solver.backends import lp_solver, solve_model
from sacplan.solver.formulation import MilpIndex, build_min_peak_model, columns_for, decision_from, fix_y
from sacplan.solver.limits import lifted
from sacplan.solver.model import MilpModel, SolveResult, relaxed
from sacplan.solver.options import SolverOptions
from sacplan.solver.problem import SacProblem


#: Branch-and-bound nodes the heuristic may spend on a min-peak MILP for its first plan when its roundings all
#: fail (deterministic; drawn from the call's work budget)
FIRST_PLAN_NODES = 1_000


def heuristic(
    problem: SacProblem, model: MilpModel, idx: MilpIndex, budget: float, opts: SolverOptions
) -> tuple[tuple[np.ndarray, np.ndarray] | None, float | None]:
    """A feasible (y, r) from the LP relaxation (round y, fix it, re-solve the LP over the ratios), and the
    LP relaxation's objective (a lower bound of the MILP's). ``opts``: back-end and threads. Deterministic: a fixed
    sequence of LPs, a min-peak MILP of at most :data:`FIRST_PLAN_NODES` nodes and a local descent of a bounded
    number of moves; the call's wall-clock limit (the safety net) only ends the LPs after the first plan, and
    that is recorded."""
    if problem.num_candidates == 0:
        return None, None
    with lifted():  # LPs only: the first plan comes even from a spent time budget
        return _heuristic(problem, model, idx, budget, opts, limits.remaining())


def _heuristic(
    problem: SacProblem, model: MilpModel, idx: MilpIndex, budget: float, opts: SolverOptions,
    left: float | None = None,
) -> tuple[tuple[np.ndarray, np.ndarray] | None, float | None]:
    t0 = time.monotonic()
    solver, threads = lp_solver(opts.backend), opts.threads
    lp = relaxed(model)
    res = solve_model(lp, solver, threads=threads)
    if res.x is None:
        return None, None
    lp_bound = res.objective
    yl = np.array([res.x[j] for j in idx.y])
    best: tuple[float, np.ndarray, np.ndarray] | None = None

    def units() -> Iterator[np.ndarray]:
        # Candidate roundings: thresholds on the LP's y; resolve nesting conflicts keeping the larger y.
        for thr in (1e-6, 0.25, 0.5, 0.75):
            if best is not None and left is not None and time.monotonic() - t0 >= left:
                limits.stopped(limits.WALL_CLOCK, "heuristic")  # safety net: a plan in hand, the clock spent
                return
            yield _unnest(problem, (yl > thr).astype(float), yl)
        if best is None:  # none fits (the LP spread y over nested chains): the units of a min-peak plan
            try:
                yield solve_min_peak(problem, opts.replace(solver=solver), node_limit=FIRST_PLAN_NODES)[1]
            except SolverError:
                return

    for y in units():
        if not y.any():
            continue
        fixed = fix_y(model, idx, y)
        sub = solve_model(fixed, solver, threads=threads)
        if sub.x is None:
            continue
        y2, r2 = decision_from(problem, idx, sub.x)
        if idx.w:
            r2 = _round_up(problem, idx, sub.x, y2)
        # drop checkpoints the LP left unused: r = 0 only costs the intercept and adds recompute extras
        y2[r2 <= 1e-12] = 0.0
        r2 = repair(problem, y2, r2 * y2, budget)
        if r2 is None:
            continue
        val = problem.cost(y2, r2)
        if best is None or val < best[0] - 1e-12:
            best = (val, y2, r2)
    if best is None:
        return None, lp_bound
    if problem.exact:
        return improve(problem, best[1], best[2], budget), lp_bound
    return (best[1], best[2]), lp_bound


def _unnest(problem: SacProblem, y: np.ndarray, score: np.ndarray) -> np.ndarray:
    """Keep, along every candidate chain, only the outermost flagged node (its flagged descendants are
    dropped; ``score`` only orders the walk)."""
    y = y.copy()
    order = sorted(range(problem.num_candidates), key=lambda s: (-score[s], s))
    for s in order:
        if y[s] < 0.5:
            continue
        p = problem.candidates[s].parent_slot
        while p >= 0:
            if y[p] > 0.5:
                y[s] = 0.0
                break
            p = problem.candidates[p].parent_slot
        if y[s] > 0.5:  # clear chosen descendants: slots are in pre-order, so they follow s contiguously
            end = problem.tree.nodes[problem.candidates[s].node].subtree_end
            t = s + 1
            while t < problem.num_candidates and problem.candidates[t].node < end:
                y[t] = 0.0
                t += 1
    return y


def _round_up(problem: SacProblem, idx: MilpIndex, x: Sequence[float], y: np.ndarray) -> np.ndarray:
    """Exact-mode ratios from a fractional LP solution ``x`` (with ``y`` fixed) that discard at least as much
    as the LP at every event, so the rounding stays feasible at nearly the LP's cost.

    A module alone takes the next option at or above its LP level. In a class of identical sequential
    blocks, the LP's fractional counts per level ``N_k = Σ w_{i,k}`` (over checkpointed members) are
    rounded up and given to the earliest members in forward order: every prefix of the forward order —
    what any fw or bw event counts — then discards ``Σ_k Δr_k · min(p, ⌈N_k⌉)``, at least the LP's, and
    only one member per level and class pays for the rounding."""
    r = np.zeros(problem.num_candidates)
    done: set[int] = set()
    for _, members in problem.classes():
        if len(members) < 2 or members[0] not in idx.w:
            continue
        seq = problem.sequential(members)
        if seq is None:
            continue
        on = [s for s in seq if y[s] > 0.5]
        o = problem.options(members[0])
        assert o is not None
        counts = [math.ceil(sum(x[idx.w[s][k]] for s in on) - 1e-6) for k in range(len(idx.w[members[0]]))]
        for i, s in enumerate(on):
            r[s] = o.ratio[sum(1 for n in counts if i < n)]
        done.update(members)
    for c in problem.candidates:
        s = c.slot
        if s in done or y[s] < 0.5:
            continue
        o = problem.options(s)
        if o is None or s not in idx.w:
            r[s] = min(1.0, max(0.0, x[idx.r[s]]))
        else:
            r[s] = o.ratio[sum(1 for j in idx.w[s] if x[j] > 1e-6)]
    return r


#: Moves :func:`improve` may make per option level of the model (a deterministic bound on its work)
MOVES_PER_LEVEL = 2


def improve(
    problem: SacProblem, y: np.ndarray, r: np.ndarray, budget: float, max_moves: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Local descent over option levels of a feasible exact-mode decision (a better incumbent).

    Moves, best saving first, each checked exactly in bytes: a checkpointed module one option cheaper, or
    not checkpointed at all; and where that alone does not fit, one to three options cheaper for it with as
    many options more for another checkpointed module as that needs, when the pair saves time. Stops when
    no move saves, after ``max_moves`` moves (default :data:`MOVES_PER_LEVEL` per option level of the model:
    deterministic), or when the call's wall-clock safety net fires (recorded). Each check is a matrix-vector step
    on :meth:`SacProblem.linear_terms`.
    """
    C, Y = problem.linear_terms()
    if np.any(problem.ev_surge >= 0):  # each move checked against the largest surge its slot can add: safe
        Y = Y.copy()
        at = np.nonzero(problem.ev_surge >= 0)[0]
        Y[at, problem.ev_surge[at]] += problem.surge_top()[at]
    nc = problem.num_candidates
    opts = [problem.options(s) for s in range(nc)]
    if any(o is None for o in opts) or nc == 0:
        return y, r
    w = np.array([c.calls * c.recompute_ms for c in problem.candidates])
    y = (np.asarray(y, dtype=float) > 0.5).astype(float)
    lvl = np.array([opts[s].level_for(float(r[s])) if y[s] > 0.5 else -1 for s in range(nc)])
    ratio = lambda s, k: 0.0 if k < 0 else opts[s].ratio[k]  # noqa: E731
    qcost = lambda s, k: 0.0 if k < 0 else w[s] * opts[s].frac[k]  # noqa: E731
    ratios_of = [np.asarray(o.ratio) for o in opts]
    r = np.array([ratio(s, lvl[s]) for s in range(nc)])
    m = problem.ev_base - C @ r + Y @ y
    lim = budget + 1e-6
    if np.max(m) > lim:
        return y, r
    if max_moves is None:
        max_moves = MOVES_PER_LEVEL * sum(len(o.ratio) for o in opts) + 16
    for _ in range(max_moves):
        if limits.past_deadline("local descent"):
            break
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


def repair(
    problem: SacProblem, y: np.ndarray, r: np.ndarray, budget: float, max_iter: int | None = None
) -> np.ndarray | None:
    """Raise discard ratios of checkpointed modules until every event fits ``budget`` exactly in bytes.

    Solvers work to a feasibility tolerance (~1 byte here); this removes such tiny violations (it only
    ever raises ratios, which lowers every event). Returns the repaired ratios, or None if impossible.
    """
    r = r.copy()
    C, _ = problem.linear_terms()
    max_iter = max_iter or (4 * len(problem.ev_base) + 16)
    for _ in range(max_iter):
        m = problem.peaks(y, r)
        e = int(np.argmax(m))
        viol = m[e] - budget
        if viol <= 0:
            return r
        weight = C[e]  # bytes each slot's calls free at this event at ratio 1 (0 everywhere at an 'other' event)
        room = weight * (1.0 - r) * (y > 0.5)
        if room.sum() < viol:
            return None
        s = int(np.argmax(room))
        r[s] = min(1.0, r[s] + (viol * (1 + 1e-12) + 1e-3) / weight[s])
    return None


def solve_min_peak(
    problem: SacProblem, opts: SolverOptions, node_limit: int | None = None
) -> tuple[int, np.ndarray, np.ndarray, SolveResult, float]:
    """Solve the min-peak MILP with ``opts``' back-end and threads within ``node_limit`` branch-and-bound nodes
    (None: the call's work budget only; the wall-clock :func:`~sacplan.solver.limits.deadline` is the safety net);
    returns (ceil of the exact peak of its solution, y, r, result, build_s)."""
    t0 = time.perf_counter()
    model, idx = build_min_peak_model(problem)
    nc = problem.num_candidates
    warm = columns_for(problem, model, idx, np.zeros(nc), np.zeros(nc))
    build_s = time.perf_counter() - t0
    res = solve_model(model, opts.backend, gap_rel=1e-9, gap_abs=1e-9, threads=opts.threads, warm_start=warm,
                      node_limit=node_limit)
    if res.x is None:
        raise SolverError(f"the min-peak MILP returned no solution ({res.solver}: {res.raw_status})")
    y, _ = decision_from(problem, idx, res.x)
    # Every event only falls as a ratio grows, so for the chosen units r = 1 is optimal: the peak depends on
    # the integer choice alone and is evaluated exactly (no solver tolerance in the reported minimum).
    r = y.copy()
    peak = problem.peak(y, r)
    return int(math.ceil(peak - 1e-6)), y, r, res, build_s
