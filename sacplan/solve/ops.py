"""Op-level selection: which forward ops of one checkpointed module to *save* so that at most
``max_saved_bytes`` stay alive, recomputing as little time as possible.

MILP (per module call; all ops of the module's first call):

* ``x_k ∈ {0, 1}``: save op ``k``'s outputs (1) or recompute them (0);
* view ops are always recomputed (``x_k = 0``): they are free and hold no storage of their own;
* an in-place op is decided together with the op whose output it modifies (``x_k = x_{inplace_of(k)}``);
  a group whose head is itself in-place with no producer inside the module is saved (its input cannot be
  recomputed inside the module);
* random ops are all saved or all recomputed together (or all saved with ``force_store_random``), so a
  recomputation never redraws some random numbers and reuses others;
* ``Σ_k x_k · save_cost_bytes_k ≤ max_saved_bytes``;
* minimise ``Σ_{k < recompute_stop, x_k = 0} runtime_ms_k`` (ops at or after ``recompute_stop`` are never
  re-run: non-reentrant checkpointing stops early once everything backward needs exists again).

The tied ops are merged into groups first (union-find), so the MILP is a 0/1 knapsack over free groups. When
the knapsack's LP relaxation (greedy by ms per byte) ends on a whole group its solution is integral and
optimal, and no solver is called; otherwise the MILP is solved exactly. Results are memoised on the op tuple
and the budget: identical blocks cost one solve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from sacplan.errors import ConfigError, InfeasibleBudgetError
from sacplan.solve.backends import OPTIMAL, MilpModel, solve_model
from sacplan.stats import OpStat


@dataclass(frozen=True)
class OpSelection:
    """Ops to save inside one checkpointed module (per call).

    Attributes:
        saved: indices (``OpStat.index``) of the ops whose outputs are saved, ascending.
        saved_bytes: ``Σ save_cost_bytes`` of the saved ops.
        recompute_ms: runtime of the recomputed ops with index < ``recompute_stop``.
        recompute_flops: FLOPs of those ops.
        solved: True when an MILP solve was needed (False: trivial or greedy-optimal).
    """

    saved: tuple[int, ...]
    saved_bytes: int
    recompute_ms: float
    recompute_flops: int
    solved: bool = False


@dataclass(frozen=True)
class _Group:
    members: tuple[int, ...]  # positions in the op sequence
    bytes: int
    ms: float
    fixed: int | None  # 0 / 1 when forced, None when free


_CACHE: dict[tuple, OpSelection] = {}
_CACHE_MAX = 4096


def clear_cache() -> None:
    """Forget memoised selections."""
    _CACHE.clear()


def _groups(ops: Sequence[OpStat], force_store_random: bool, stop: int) -> list[_Group]:
    n = len(ops)
    pos = {op.index: p for p, op in enumerate(ops)}
    parent = list(range(n))

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    def union(a: int, b: int) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    forced_save = [False] * n
    for p, op in enumerate(ops):
        if op.inplace_of is None:
            continue
        q = pos.get(op.inplace_of)
        if q is None or q == p:
            forced_save[p] = True  # modifies something produced outside the module: keep it
        else:
            union(p, q)
    rand = [p for p, op in enumerate(ops) if op.is_random]
    if force_store_random:
        for p in rand:
            forced_save[p] = True
    else:
        for a, b in zip(rand, rand[1:]):
            union(a, b)
    members: dict[int, list[int]] = {}
    for p in range(n):
        members.setdefault(find(p), []).append(p)
    out = []
    for root in sorted(members):
        ms = members[root]
        has_view = any(ops[p].is_view for p in ms)
        fixed: int | None
        if has_view and all(ops[p].is_view for p in ms):
            fixed = 0
        elif has_view:
            # A view tied to real ops (an in-place op modifying a view): views are always recomputed, so the
            # whole group is recomputed (as PyTorch's reference MILP does).
            fixed = 0
        elif any(forced_save[p] for p in ms):
            fixed = 1
        else:
            fixed = None
        out.append(
            _Group(
                members=tuple(ms),
                bytes=sum(max(0, int(ops[p].save_cost_bytes)) for p in ms),
                ms=sum(float(ops[p].runtime_ms) for p in ms if ops[p].index < stop),
                fixed=fixed,
            )
        )
    return out


def _result(ops: Sequence[OpStat], saved_pos: set[int], stop: int, solved: bool) -> OpSelection:
    saved = tuple(sorted(ops[p].index for p in saved_pos))
    sb = sum(max(0, int(ops[p].save_cost_bytes)) for p in saved_pos)
    rec = [op for p, op in enumerate(ops) if p not in saved_pos and op.index < stop]
    return OpSelection(
        saved=saved,
        saved_bytes=sb,
        recompute_ms=float(sum(op.runtime_ms for op in rec)),
        recompute_flops=int(sum(op.flops for op in rec)),
        solved=solved,
    )


def select_ops(
    ops: Sequence[OpStat],
    max_saved_bytes: int,
    *,
    force_store_random: bool = False,
    solver: str = "cbc",
    recompute_stop: int | None = None,
) -> OpSelection:
    """Choose the ops of one module to save under ``max_saved_bytes`` (see the module docstring).

    Args:
        ops: the module's forward ops (:class:`~sacplan.stats.OpStat`, first call).
        max_saved_bytes: bytes the saved ops may hold, per call (``floor(A · (1 - r))`` for discard ratio
            ``r``).
        force_store_random: save every random op (no recomputation of random numbers at all).
        solver: MILP back-end ("cbc" or "highs") for the cases the greedy cannot settle.
        recompute_stop: ops with index ≥ this are never recomputed (``ModuleStats.recompute_stop``);
            None = all ops may be recomputed.

    Raises:
        InfeasibleBudgetError: the ops that must be saved exceed ``max_saved_bytes``.
    """
    if max_saved_bytes < 0:
        raise ConfigError(f"max_saved_bytes must be >= 0, got {max_saved_bytes}")
    ops = tuple(ops)
    stop = (max((op.index for op in ops), default=-1) + 1) if recompute_stop is None else int(recompute_stop)
    key = (ops, int(max_saved_bytes), bool(force_store_random), stop, str(solver).lower())
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    res = _select(ops, int(max_saved_bytes), force_store_random, solver, stop)
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.clear()
    _CACHE[key] = res
    return res


def _select(ops: tuple[OpStat, ...], cap: int, force_store_random: bool, solver: str, stop: int) -> OpSelection:
    groups = _groups(ops, force_store_random, stop)
    saved: set[int] = set()
    used = 0
    free: list[_Group] = []
    for g in groups:
        if g.fixed == 1:
            saved.update(g.members)
            used += g.bytes
        elif g.fixed is None:
            if g.ms <= 0.0:
                continue  # saving it gains nothing
            if g.bytes == 0:
                saved.update(g.members)  # free to save
                continue
            free.append(g)
    if used > cap:
        raise InfeasibleBudgetError(
            cap,
            used,
            "(op level: the in-place/random ops that must be saved hold more than max_saved_bytes)",
        )
    room = cap - used
    cand = [g for g in free if g.bytes <= room]
    if not cand:
        return _result(ops, saved, stop, False)
    # LP relaxation of the knapsack: take groups by ms per byte; integral => optimal.
    order = sorted(range(len(cand)), key=lambda i: (-cand[i].ms / cand[i].bytes, cand[i].bytes, i))
    left = room
    take: list[int] = []
    fractional = False
    for i in order:
        g = cand[i]
        if g.bytes <= left:
            take.append(i)
            left -= g.bytes
        else:
            fractional = True
            break
    if not fractional:
        for i in take:
            saved.update(cand[i].members)
        return _result(ops, saved, stop, False)
    # Exact 0/1 knapsack by MILP; the greedy fill is a feasible warm start.
    model = MilpModel(name="sacplan_ops")
    # Scale bytes to the budget so coefficients are O(1); maximise saved ms == minimise -saved ms.
    scale = float(room)
    cols = [model.add_col(f"x{i}", 0.0, 1.0, True, -g.ms) for i, g in enumerate(cand)]
    model.add_row("bytes", cols, [g.bytes / scale for g in cand], ub=1.0)
    warm = [0.0] * len(cand)
    for i in take:
        warm[i] = 1.0
    res = solve_model(model, solver, gap_rel=0.0, gap_abs=1e-9, warm_start=warm)
    if res.status != OPTIMAL or res.x is None:  # pragma: no cover - a knapsack always has x = 0
        chosen = take
    else:
        chosen = [i for i, v in enumerate(res.x) if v > 0.5]
        # Guard the byte budget exactly (the solver works in scaled floats).
        if sum(cand[i].bytes for i in chosen) > room:
            chosen = take
    for i in chosen:
        saved.update(cand[i].members)
    return _result(ops, saved, stop, True)


def max_saved_bytes_for(discard_ratio: float, max_discard_bytes: int) -> int:
    """``floor(A · (1 - r))`` with the ratio clipped to [0, 1]."""
    r = min(1.0, max(0.0, float(discard_ratio)))
    return int(math.floor(max_discard_bytes * (1.0 - r)))


@dataclass(frozen=True)
class ModuleOptions:
    """The exact recompute-vs-memory options of one checkpointed module (per call), for the exact MILP.

    Option ``k`` discards ``ratio[k] · A`` bytes (``A`` = the trade-off's ``max_discard_bytes``) and
    recomputes ``frac[k] · R`` ms (``R`` = its ``full_recompute_ms``); both strictly increase with ``k``
    (dominated options are dropped). ``capacity[k]`` is the ``max_saved_bytes`` whose :func:`select_ops`
    realises it exactly (``None``: full checkpoint, nothing saved but what must be).
    """

    ratio: tuple[float, ...]
    frac: tuple[float, ...]
    capacity: tuple[int | None, ...]

    def level_for(self, r: float) -> int:
        """The cheapest option discarding at least ratio ``r`` (the last one if none does)."""
        for k, rk in enumerate(self.ratio):
            if rk >= r - 1e-12:
                return k
        return len(self.ratio) - 1


def module_options(
    ops: Sequence[OpStat],
    max_discard_bytes: int,
    full_recompute_ms: float,
    ratios: Sequence[float],
    *,
    recompute_stop: int | None = None,
    max_options: int = 16,
    solver: str = "cbc",
) -> ModuleOptions:
    """Options of one module from exact op-level selections at the discard ratios ``ratios``.

    For each ratio the knapsack :func:`select_ops` is solved at ``max_saved_bytes ≈ A·(1 - r)``; its
    *realised* discard and recompute form one option (at least as good as the greedy vertex the ratio came
    from: the knapsack is exact). The full checkpoint ``(1, 1)`` is always an option. Dominated options
    (no larger discard for no smaller cost) are dropped; above ``max_options`` the ones whose removal
    costs least (the next kept option's extra cost times the discard span it covers) are dropped, keeping
    the first and the last.
    """
    A = int(max_discard_bytes)
    R = float(full_recompute_ms)
    pts: list[tuple[float, float, int | None]] = [(1.0, 1.0, None)]
    if A > 0 and R > 0:
        for r in sorted(set(float(min(1.0, max(0.0, x))) for x in ratios)):
            # nearest byte: the option records what the selection realises, so no floor is needed (a floor
            # of 0.2·A computed in floats can land one byte short of a whole op and lose that option)
            cap = max(0, min(A, int(round(A * (1.0 - r)))))
            try:
                sel = select_ops(ops, cap, solver=solver, recompute_stop=recompute_stop)
            except InfeasibleBudgetError:
                continue
            d = A - sel.saved_bytes
            if d < 0:
                continue
            pts.append((min(1.0, d / A), min(1.0, sel.recompute_ms / R), cap))
    # Pareto front: by ratio descending, keep strictly cheaper options
    pts.sort(key=lambda p: (-p[0], p[1], p[2] is not None))
    front: list[tuple[float, float, int | None]] = []
    for p in pts:
        if not front or p[1] < front[-1][1] - 1e-12:
            if front and abs(p[0] - front[-1][0]) <= 1e-15:
                continue
            front.append(p)
    front.reverse()
    while len(front) > max(2, max_options):
        # drop the interior option whose loss is smallest: (q_next - q_k) · (r_k - r_prev)
        loss = [
            ((front[k + 1][1] - front[k][1]) * (front[k][0] - front[k - 1][0]), k) for k in range(1, len(front) - 1)
        ]
        front.pop(min(loss)[1])
    return ModuleOptions(
        ratio=tuple(p[0] for p in front), frac=tuple(p[1] for p in front), capacity=tuple(p[2] for p in front)
    )


def fractional_lines(
    ops: Sequence[OpStat], max_discard_bytes: int, full_recompute_ms: float, *, recompute_stop: int | None = None
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Lines ``q ≥ slope·r + intercept`` whose max lies below *every* achievable option of one module.

    The LP relaxation of :func:`select_ops`'s knapsack (save groups fractionally, most ms per byte first) gives,
    for each discard, a recompute time no integer selection beats; its vertices (plus the full checkpoint
    ``(1, 1)``) are convexified into their lower hull. Units as :class:`ModuleOptions` (``r = d/A``,
    ``q = ms/R``). Used by :func:`sacplan.solve.recompute_lower_bound`.
    """
    A = float(max_discard_bytes)
    R = float(full_recompute_ms)
    ops = tuple(ops)
    stop = (max((op.index for op in ops), default=-1) + 1) if recompute_stop is None else int(recompute_stop)
    forced = 0
    base_ms = 0.0
    free: list[_Group] = []
    for g in _groups(ops, False, stop):
        if g.fixed == 1:
            forced += g.bytes
        elif g.fixed == 0 or g.ms <= 0.0:
            base_ms += g.ms  # always recomputed (views, or nothing to gain by saving)
        elif g.bytes > 0:
            free.append(g)
    # start: every free group saved; then give them up least valuable (ms per byte) first
    free.sort(key=lambda g: (g.ms / g.bytes, g.bytes))
    saved = forced + sum(g.bytes for g in free)
    ms = base_ms
    pts = [((A - saved) / A, ms / R)]
    for g in free:
        saved -= g.bytes
        ms += g.ms
        pts.append(((A - saved) / A, ms / R))
    pts.append((1.0, 1.0))
    # lower convex hull (Andrew's monotone chain, lower part)
    pts = sorted(set(pts))
    hull: list[tuple[float, float]] = []
    for p in pts:
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (x2 - x1) * (p[1] - y1) - (y2 - y1) * (p[0] - x1) <= 0:
                hull.pop()
            else:
                break
        hull.append(p)
    slopes, intercepts = [], []
    for (x1, y1), (x2, y2) in zip(hull, hull[1:]):
        if x2 - x1 <= 1e-15:
            continue
        s = (y2 - y1) / (x2 - x1)
        slopes.append(s)
        intercepts.append(y1 - s * x1)
    if not slopes:
        slopes, intercepts = [0.0], [min(1.0, hull[0][1]) if hull else 0.0]
    return tuple(slopes), tuple(intercepts)
