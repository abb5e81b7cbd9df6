"""Op-level choices of one checkpointed module: which of its forward ops to *save* (:func:`select_ops`: one byte
budget), its exact options for the module-level MILP (:func:`module_options`), and lines below every option for
lower bounds (:func:`fractional_lines`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from sacplan.errors import ConfigError, InfeasibleBudgetError
from sacplan.solver.front import FRONT_CAP, front_of_groups, lower_hull_indices, thin_front
from sacplan.opgroups import OpGroup, split_groups, stop_index
from sacplan.solver.knapsack import GreedyFill, OpSelection, knapsack, selection_of
from sacplan.stats import OpStat
from sacplan.tradeoff import greedy_vertices, segment_lines


_CACHE: dict[tuple, OpSelection] = {}
_CACHE_MAX = 4096


def clear_cache() -> None:
    """Forget memoised selections."""
    _CACHE.clear()


def select_ops(
    ops: Sequence[OpStat],
    max_saved_bytes: int,
    *,
    force_store_random: bool = False,
    solver: str = "cbc",
    recompute_stop: int | None = None,
) -> OpSelection:
    """The save list of one module's forward ``ops`` (first call) holding at most ``max_saved_bytes`` per call
    (``floor(A · (1 - r))`` for discard ratio ``r``) that recomputes the least: the exact knapsack of
    :mod:`sacplan.solver.knapsack` (``solver``: its MILP back-end), memoised (identical blocks cost one solve).
    ``force_store_random``: save every random op; ``recompute_stop``: ops with index ≥ it are never recomputed
    (``ModuleStats.recompute_stop``; None: all may be).

    Raises:
        InfeasibleBudgetError: the ops that must be saved exceed ``max_saved_bytes``.
    """
    if max_saved_bytes < 0:
        raise ConfigError(f"max_saved_bytes must be >= 0, got {max_saved_bytes}")
    ops = tuple(ops)
    stop = stop_index(ops, recompute_stop)
    key = (ops, int(max_saved_bytes), bool(force_store_random), stop, str(solver).lower())
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    always, free, _ = split_groups(ops, force_store_random, stop)
    res = knapsack(GreedyFill(ops, always, free, stop), int(max_saved_bytes), solver)[0]
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.clear()
    _CACHE[key] = res
    return res


def max_saved_bytes_for(discard_ratio: float, max_discard_bytes: int) -> int:
    """``floor(A · (1 - r))`` with the ratio clipped to [0, 1]."""
    r = min(1.0, max(0.0, float(discard_ratio)))
    return int(math.floor(max_discard_bytes * (1.0 - r)))


@dataclass(frozen=True)
class ModuleOptions:
    """The exact recompute-vs-memory options of one checkpointed module (per call), for the exact MILP: option ``k``
    discards ``ratio[k] · A`` bytes (``A``: the trade-off's ``max_discard_bytes``) and recomputes ``frac[k] · R`` ms
    (``R``: its ``full_recompute_ms``), both strictly increasing with ``k``, realised exactly by ``selection[k]``
    (``None``: the full checkpoint). ``complete``: every Pareto-optimal save list of the module (nothing pruned), so
    an MILP over them ranges over all plans.
    """

    ratio: tuple[float, ...]
    frac: tuple[float, ...]
    selection: tuple[OpSelection | None, ...]
    complete: bool = False
    #: 0 unless the time budget ran out while the options were built: then some option's save list is a greedy
    #: fill, and an exact knapsack at its ratio might recompute up to this fraction of ``R`` less (per call)
    slack_frac: float = 0.0

    @property
    def capacity(self) -> tuple[int | None, ...]:
        """Saved bytes of each option's selection (``None`` for the full checkpoint)."""
        return tuple(None if sel is None else sel.saved_bytes for sel in self.selection)

    def level_for(self, r: float) -> int:
        """The cheapest option discarding at least ratio ``r`` (the last one if none does)."""
        for k, rk in enumerate(self.ratio):
            if rk >= r - 1e-12:
                return k
        return len(self.ratio) - 1


#: Free op groups above which :func:`module_options` samples knapsacks instead (the DP costs groups × front)
DP_MAX_GROUPS = 256


def module_options(
    ops: Sequence[OpStat],
    max_discard_bytes: int,
    full_recompute_ms: float,
    ratios: Sequence[float] = (),
    *,
    recompute_stop: int | None = None,
    max_options: int | None = 16,
    solver: str = "cbc",
    selective_frac: float = 0.0,
    full_selective: bool = False,
) -> ModuleOptions:
    """Options of one module: its exact Pareto front of save lists (:mod:`sacplan.solver.front`), each realised as
    an :class:`OpSelection`, with the full checkpoint ``(1, 1)``; dominated options dropped. Above ``max_options``
    (None: keep all; ``complete`` says whether that is every Pareto-optimal save list) they are thinned by
    :func:`~sacplan.solver.front.thin_front` (vertices of the lower convex hull, what the LP leans on, last).

    A module with more than :data:`DP_MAX_GROUPS` free op groups (a stage of many blocks) given ``ratios`` gets the
    exact knapsacks of :func:`select_ops` at those discard ratios instead (``complete`` False).

    ``selective_frac``: the selective mode's dispatch per call (:func:`sacplan.sacmode.dispatch_ms`) as a fraction of
    ``R``, added to every save list's cost, and to the full checkpoint's when it runs selective too
    (``full_selective``): a save list must beat the plain full checkpoint by more.
    """
    ops = tuple(ops)
    A = int(max_discard_bytes)
    R = float(full_recompute_ms)
    stop = stop_index(ops, recompute_stop)
    complete = True
    slacks: dict[OpSelection, float] = {}
    saved_groups, free, _ = split_groups(ops, False, stop)
    # The plain full checkpoint saves only what is forced (in-place writes to outside tensors) and recomputes
    # every other op before the stop, free ones included (as apply_plan does): its cost may exceed R.
    forced = {p for g in saved_groups if g.fixed == 1 for p in g.members}
    q_full = selection_of(ops, forced, stop).recompute_ms / R if R > 0 else 1.0
    pts: list[tuple[float, float, OpSelection | _Pending | None]] = [(1.0, max(1.0, q_full), None)]
    if A > 0 and R > 0:
        if len(free) <= DP_MAX_GROUPS or not ratios:
            front, complete = _front_points(ops, saved_groups, free, stop, A, R)
            pts += front
        else:  # a large module (a stage of many blocks): exact knapsacks at the sampled ratios only
            complete = False
            slacks = _sampled(GreedyFill(ops, saved_groups, free, stop), ratios, A, solver)
            pts += [(min(1.0, (A - sel.saved_bytes) / A), min(1.0, sel.recompute_ms / R), sel)
                    for sel in slacks if A - sel.saved_bytes >= 0]
    if selective_frac > 0:
        pts = [(r, q + (selective_frac if sel is not None or full_selective else 0.0), sel) for r, q, sel in pts]
    # Pareto front: by ratio descending, keep strictly cheaper options. On a tie a save list beats the plain full
    # checkpoint: it names the free ops (the module's output op) that a full checkpoint would recompute; an
    # empty save list is the full checkpoint itself.
    kept = _undominated(sorted(pts, key=lambda p: (-p[0], p[1], 1 if p[2] is None else (0 if p[2].saved else 2))))
    if max_options is not None and len(kept) > max(2, max_options):
        complete = False
        kept = [kept[k] for k in thin_front([(p[0], p[1]) for p in kept], max(2, max_options))]
    if any(isinstance(p[2], _Pending) for p in kept):
        kept = _realise(ops, kept, saved_groups, free, stop, A, R, selective_frac)
    slack = max([0.0] + [slacks.get(p[2], 0.0) for p in kept if p[2] is not None])
    return ModuleOptions(
        ratio=tuple(p[0] for p in kept),
        frac=tuple(p[1] for p in kept),
        selection=tuple(p[2] for p in kept),
        complete=complete,
        slack_frac=min(1.0, slack / R) if R > 0 else 0.0,
    )


def _front_points(
    ops: tuple[OpStat, ...], saved_groups: Sequence[OpGroup], free: Sequence[OpGroup], stop: int, A: int, R: float,
) -> tuple[list[tuple[float, float, "_Pending"]], bool]:
    """The free groups' Pareto front as ``(ratio, frac, pending selection)`` points, priced from the DP's own sums
    (only the points :func:`module_options` keeps are realised: of a Llama root's ~5,000, 16), and whether it is
    the whole front."""
    front, complete = front_of_groups(free, FRONT_CAP)
    always = {p for g in saved_groups for p in g.members}
    always_bytes = sum(max(0, int(ops[p].save_cost_bytes)) for p in always)
    # recompute ms priced exactly as a realised selection is (math.fsum of the recomputed ops): fsum is exact
    # over its inputs, so the exact partials of every op's ms less the saved groups' ms give it
    base = _partials([op.runtime_ms for p, op in enumerate(ops) if p not in always and op.index < stop])
    terms = [[-ops[p].runtime_ms for p in g.members if ops[p].index < stop] for g in free]
    chunks: dict[tuple[int, int], list[float]] = {}  # (byte of the mask, its value) -> the terms of its groups
    width = (len(free) + 7) // 8
    pts = []
    for b, _, mask in front:
        d = A - (always_bytes + b)
        if d < 0:
            continue
        xs = list(base)
        for c, v in enumerate(mask.to_bytes(width, "little")):  # fsum is exact: the order of its terms is free
            if v:
                if (c, v) not in chunks:
                    chunks[c, v] = [x for i in range(8) if v >> i & 1 for x in terms[8 * c + i]]
                xs.extend(chunks[c, v])
        pts.append((min(1.0, d / A), min(1.0, math.fsum(xs) / R), _Pending(mask, bool(always) or mask != 0)))
    return pts, complete


def _sampled(fill: GreedyFill, ratios: Sequence[float], A: int, solver: str) -> dict[OpSelection, float]:
    """The exact knapsacks at the sampled discard ``ratios`` (past the wall-clock safety net the greedy fill),
    each with its slack (ms per call an exact knapsack might save beyond it; 0 when exact), in ratio order."""
    slacks: dict[OpSelection, float] = {}
    for r in sorted(set(float(min(1.0, max(0.0, x))) for x in ratios)):
        cap = max(0, min(A, int(round(A * (1.0 - r)))))
        try:  # past the wall-clock safety net the fill, within sl
            sel, sl = knapsack(fill, cap, solver, safety_net="op-level options")
        except InfeasibleBudgetError:
            continue
        slacks[sel] = max(slacks.get(sel, 0.0), sl)
    return slacks


def _partials(xs: Sequence[float]) -> list[float]:
    """Non-overlapping floats whose exact sum is the exact sum of ``xs`` (Shewchuk's partials, as ``math.fsum``
    keeps them), so ``fsum(_partials(a) + b) == fsum(a + b)``."""
    parts: list[float] = []
    for x in xs:
        i = 0
        for y in parts:
            if abs(x) < abs(y):
                x, y = y, x
            hi = x + y
            lo = y - (hi - x)
            if lo:
                parts[i] = lo
                i += 1
            x = hi
        parts[i:] = [x]
    return parts


@dataclass(frozen=True)
class _Pending:
    """A front point of :func:`module_options` not yet realised: the free groups it saves (bit mask)."""

    mask: int
    saved: bool  # it saves something (what a realised selection's ``saved`` tuple says by its truth)


def _realise(
    ops: Sequence[OpStat], kept: list, saved_groups: Sequence[OpGroup], free: Sequence[OpGroup], stop: int, A: int,
    R: float, selective_frac: float = 0.0,
) -> list[tuple[float, float, OpSelection | None]]:
    """The kept options with their selections built and priced exactly (``math.fsum`` over the recomputed ops, as
    every selection is, plus ``selective_frac``); an option the exact prices show dominated (equal ratio or no
    cheaper, at 1e-12) goes."""
    always = {p for g in saved_groups for p in g.members}
    out: list[tuple[float, float, OpSelection | None]] = []
    for r, q, sel in kept:
        if isinstance(sel, _Pending):
            saved = set(always)
            for i, g in enumerate(free):
                if sel.mask >> i & 1:
                    saved.update(g.members)
            sel = selection_of(ops, saved, stop)
            r, q = min(1.0, (A - sel.saved_bytes) / A), min(1.0, sel.recompute_ms / R) + selective_frac
        out.append((r, q, sel))
    return _undominated(sorted(out, key=lambda p: (-p[0], p[1])))


def _undominated(pts: list) -> list:
    """Of ``(ratio, frac, selection)`` points sorted by ratio descending, those strictly cheaper (by 1e-12) than
    every point kept before them at a different ratio (by 1e-15): the options, by ratio ascending."""
    kept: list = []
    for p in pts:
        if not kept or (p[1] < kept[-1][1] - 1e-12 and abs(p[0] - kept[-1][0]) > 1e-15):
            kept.append(p)
    return kept[::-1]


def fractional_lines(
    ops: Sequence[OpStat], max_discard_bytes: int, full_recompute_ms: float, *, recompute_stop: int | None = None
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Lines ``q ≥ slope·r + intercept`` whose max lies below *every* achievable option of one module: the lower
    hull of the knapsack's LP relaxation (its vertices: :func:`~sacplan.tradeoff.greedy_vertices`, plus the full
    checkpoint ``(1, 1)``), a recompute time no integer selection beats. Units as :class:`ModuleOptions`."""
    A = float(max_discard_bytes)
    R = float(full_recompute_ms)
    ops = tuple(ops)
    # the fill from every free group saved down to none, least ms per byte given up first
    vertices, _ = greedy_vertices(ops, int(max_discard_bytes), stop_index(ops, recompute_stop))
    pts = [(d / A, ms / R) for d, ms, _ in vertices]
    pts.append((1.0, 1.0))
    pts = sorted(set(pts))
    hull = [pts[i] for i in sorted(lower_hull_indices(pts))]
    slopes, intercepts = segment_lines(hull)
    if not slopes:
        slopes, intercepts = [0.0], [min(1.0, hull[0][1]) if hull else 0.0]
    return tuple(slopes), tuple(intercepts)
