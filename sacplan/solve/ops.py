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

import heapq

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from sacplan.errors import ConfigError, InfeasibleBudgetError
from sacplan.solve import limits
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


def _split(
    ops: Sequence[OpStat], force_store_random: bool, stop: int
) -> tuple[list[_Group], list[_Group], list[_Group]]:
    """The groups as every selection treats them: ``(always saved, free to choose, never saved)``.

    Always saved: forced ones (in-place on outside inputs, random with ``force_store_random``) and those that
    cost no bytes yet save time. Never saved: views (and what is tied to them) and groups that save no time.
    Free: the rest — the knapsack items."""
    always, free, never = [], [], []
    for g in _groups(ops, force_store_random, stop):
        if g.fixed == 1 or (g.fixed is None and g.bytes == 0 and g.ms > 0.0):
            always.append(g)
        elif g.fixed is None and g.ms > 0.0:
            free.append(g)
        else:
            never.append(g)
    return always, free, never


def _result(ops: Sequence[OpStat], saved_pos: set[int], stop: int, solved: bool) -> OpSelection:
    saved = tuple(sorted(ops[p].index for p in saved_pos))
    sb = sum(max(0, int(ops[p].save_cost_bytes)) for p in saved_pos)
    rec = [op for p, op in enumerate(ops) if p not in saved_pos and op.index < stop]
    return OpSelection(
        saved=saved,
        saved_bytes=sb,
        recompute_ms=math.fsum(op.runtime_ms for op in rec),
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
    always, free, _ = _split(ops, force_store_random, stop)
    return _knapsack(ops, always, free, cap, solver, stop)[0]


def _knapsack(
    ops: tuple[OpStat, ...], always: Sequence[_Group], free: Sequence[_Group], cap: int, solver: str, stop: int,
    milp: bool = True,
) -> tuple[OpSelection, float]:
    """The 0/1 knapsack of :func:`select_ops` over groups already split by :func:`_split`.

    Returns ``(selection, slack_ms)``: ``slack_ms`` is 0 when the selection is optimal, else (``milp=False``
    and the greedy fill was fractional) the ms per call the knapsack's LP relaxation saves beyond the greedy
    fill returned — no save list under ``cap`` recomputes less than ``selection.recompute_ms - slack_ms``."""
    saved = {p for g in always for p in g.members}
    used = sum(g.bytes for g in always)
    if used > cap:
        raise InfeasibleBudgetError(
            cap,
            used,
            "(op level: the in-place/random ops that must be saved hold more than max_saved_bytes)",
        )
    room = cap - used
    cand = [g for g in free if g.bytes <= room]
    if not cand:
        return _result(ops, saved, stop, False), 0.0
    # LP relaxation of the knapsack: take groups by ms per byte; integral => optimal. A fill that uses the room
    # exactly is integral too (the next group's fraction is 0): the trade-off's greedy vertices are such fills,
    # so module_options needs no MILP for them (Mistral-7B's decoder stack: 989 of its 991 sampled ratios).
    order = sorted(range(len(cand)), key=lambda i: (-cand[i].ms / cand[i].bytes, cand[i].bytes, i))
    left = room
    take: list[int] = []
    fractional = False
    slack = 0.0
    for i in order:
        g = cand[i]
        if g.bytes <= left:
            take.append(i)
            left -= g.bytes
        else:
            fractional = left > 0
            slack = left * g.ms / g.bytes
            break
    if not fractional or not milp:
        for i in take:
            saved.update(cand[i].members)
        return _result(ops, saved, stop, False), (slack if fractional else 0.0)
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
    if res.status != OPTIMAL or res.x is None:  # the time budget ran out (limits.deadline): the greedy fill
        chosen = take
        if math.isfinite(res.bound):  # the solver's bound on saved ms, when tighter than the LP's
            slack = max(0.0, min(slack, -res.bound - sum(cand[i].ms for i in take)))
    else:
        slack = 0.0
        chosen = [i for i, v in enumerate(res.x) if v > 0.5]
        # Guard the byte budget exactly (the solver works in scaled floats).
        if sum(cand[i].bytes for i in chosen) > room:
            chosen = take
    for i in chosen:
        saved.update(cand[i].members)
    return _result(ops, saved, stop, True), slack


class _Greedy:
    """The greedy fill of :func:`_knapsack` (``milp=False``) at many capacities over one module's split: the
    density order and per-op arrays are built once, each capacity then costs a few vector operations (a stage
    of 32 decoder blocks is sampled at ~1000 ratios)."""

    def __init__(self, ops: tuple[OpStat, ...], always: Sequence[_Group], free: Sequence[_Group], stop: int) -> None:
        order = sorted(range(len(free)), key=lambda i: (-free[i].ms / free[i].bytes, free[i].bytes, i))
        self.free = [free[i] for i in order]
        self.bytes = np.array([g.bytes for g in self.free], dtype=np.int64)
        self.ms = np.array([g.ms for g in self.free], dtype=float)
        self.used = sum(g.bytes for g in always)
        n = len(ops)
        self.group = np.full(n, -1, dtype=np.int64)  # position -> its free group's rank in density order
        for k, g in enumerate(self.free):
            self.group[list(g.members)] = k
        self.always = np.zeros(n, dtype=bool)
        for g in always:
            self.always[list(g.members)] = True
        self.index = np.array([op.index for op in ops], dtype=np.int64)
        self.runtime = np.array([float(op.runtime_ms) for op in ops], dtype=float)
        flops = [int(op.flops) for op in ops]
        # int64 sums when no sum can overflow (a 7B stage: ~1e17 FLOPs), else Python ints
        self.flops: np.ndarray | list[int] = np.array(flops, dtype=np.int64) if sum(map(abs, flops)) < 2**62 else flops
        self.before_stop = self.index < stop

    def __call__(self, cap: int) -> tuple[OpSelection, float]:
        """``(selection, slack_ms)`` as :func:`_knapsack` returns them with ``milp=False``."""
        if self.used > cap:
            raise InfeasibleBudgetError(
                cap, self.used, "(op level: the in-place/random ops that must be saved hold more than max_saved_bytes)"
            )
        room = cap - self.used
        fits = np.nonzero(self.bytes <= room)[0]  # the knapsack's items, in density order
        cum = np.cumsum(self.bytes[fits])
        k = int(np.searchsorted(cum, room, side="right"))  # items fit in turn until the first one that does not
        take = np.zeros(len(self.free) + 1, dtype=bool)
        take[fits[:k]] = True
        left = room - (int(cum[k - 1]) if k else 0)
        slack = 0.0
        if k < len(fits) and left > 0:
            nxt = int(fits[k])
            slack = left * float(self.ms[nxt]) / float(self.bytes[nxt])
        saved = self.always | take[self.group]  # group -1 (not free) reads the last entry: False
        rec = ~saved & self.before_stop
        sel = OpSelection(
            saved=tuple(sorted(self.index[saved].tolist())),
            saved_bytes=int(self.used + int(self.bytes[take[:-1]].sum())),
            recompute_ms=math.fsum(self.runtime[rec].tolist()),
            recompute_flops=(int(self.flops[rec].sum()) if isinstance(self.flops, np.ndarray)
                             else sum(f for f, r in zip(self.flops, rec.tolist()) if r)),
            solved=False,
        )
        return sel, slack


def max_saved_bytes_for(discard_ratio: float, max_discard_bytes: int) -> int:
    """``floor(A · (1 - r))`` with the ratio clipped to [0, 1]."""
    r = min(1.0, max(0.0, float(discard_ratio)))
    return int(math.floor(max_discard_bytes * (1.0 - r)))


@dataclass(frozen=True)
class ModuleOptions:
    """The exact recompute-vs-memory options of one checkpointed module (per call), for the exact MILP.

    Option ``k`` discards ``ratio[k] · A`` bytes (``A`` = the trade-off's ``max_discard_bytes``) and
    recomputes ``frac[k] · R`` ms (``R`` = its ``full_recompute_ms``); both strictly increase with ``k``
    (dominated options are dropped). ``selection[k]`` is the op selection that realises option ``k`` exactly
    (``None``: full checkpoint, nothing saved); :attr:`capacity` gives its saved bytes (``None`` likewise).
    ``complete`` is True when the options are *every* Pareto-optimal save list of the module (nothing pruned),
    so an MILP over them ranges over all plans.
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


#: Pareto points the exact front may hold before it is thinned (see :func:`pareto_front`)
FRONT_CAP = 20000
#: Free op groups above which :func:`module_options` samples knapsacks instead (the DP costs groups × front)
DP_MAX_GROUPS = 256


def pareto_front(
    ops: Sequence[OpStat], *, recompute_stop: int | None = None, cap: int = FRONT_CAP
) -> tuple[list[tuple[int, float, int]], list[_Group], set[int], bool]:
    """Every Pareto-optimal choice of free op groups to save: fewest bytes for the most ms saved.

    A dynamic programme over the free groups (the 0/1 knapsack of :func:`select_ops` for *every* capacity at
    once): the front after group ``g`` is the Pareto-maximal union of the front before it and the front with
    ``g`` added. Returns ``(front, free groups, positions always saved, complete)`` where ``front`` holds
    ``(bytes, ms, mask)`` by increasing bytes and ms, ``mask`` the bit set of chosen free groups. Should the
    front exceed ``cap`` points it is thinned to the best point per byte bucket (``complete`` is then False);
    a Llama-7B block has 44 free groups and a 438-point front (2 ms).
    """
    ops = tuple(ops)
    stop = (max((op.index for op in ops), default=-1) + 1) if recompute_stop is None else int(recompute_stop)
    saved_groups, free, _ = _split(ops, False, stop)
    front, complete = _front(free, cap)
    return front, free, {p for g in saved_groups for p in g.members}, complete


def _front(free: Sequence[_Group], cap: int) -> tuple[list[tuple[int, float, int]], bool]:
    """The DP of :func:`pareto_front` over the free groups: ``(front, complete)``.

    Per group, the front so far and its copy with the group saved are merged (by bytes, then most ms saved;
    stable) and only points saving strictly more ms than every cheaper one stay (relative tolerance 1e-12);
    above ``cap`` points, each of ``cap`` equal byte buckets keeps its point saving the most ms. Arrays with
    back-pointers per group, masks rebuilt at the end: the same points, sums and order as a list-of-tuples DP.
    """
    B = np.zeros(1, dtype=np.int64)
    M = np.zeros(1, dtype=float)
    complete = True
    steps: list[tuple[np.ndarray, np.ndarray]] = []  # per group: (index into the previous front, group taken)
    for g in free:
        nb = np.concatenate([B, B + int(g.bytes)])
        nm = np.concatenate([M, M + float(g.ms)])
        src = np.concatenate([np.arange(len(B)), np.arange(len(B))])
        took = np.concatenate([np.zeros(len(B), dtype=bool), np.ones(len(B), dtype=bool)])
        order = np.lexsort((-nm, nb))  # by bytes, then most ms; stable
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
    masks = [0] * len(B)
    idx = np.arange(len(B))
    for i in range(len(steps) - 1, -1, -1):
        src, took = steps[i]
        for j in np.nonzero(took[idx])[0].tolist():
            masks[j] |= 1 << i
        idx = src[idx]
    return [(int(b), float(m), k) for b, m, k in zip(B.tolist(), M.tolist(), masks)], complete


def module_options(
    ops: Sequence[OpStat],
    max_discard_bytes: int,
    full_recompute_ms: float,
    ratios: Sequence[float] = (),
    *,
    recompute_stop: int | None = None,
    max_options: int | None = 16,
    solver: str = "cbc",
) -> ModuleOptions:
    """Options of one module: its exact Pareto front of save lists (:func:`pareto_front`), at most ``max_options``.

    Each front point is realised as an :class:`OpSelection` and recorded by what it realises (discard ratio,
    recompute fraction); the full checkpoint ``(1, 1)`` is always an option. Dominated options (no larger
    discard for no smaller cost) are dropped. Above ``max_options`` (None: keep all, and ``complete`` says
    whether that is every Pareto-optimal save list) interior options are dropped one at a time, the one whose
    removal costs least first (the next kept option's extra cost times the discard span it covers), vertices
    of the front's lower convex hull last (they are what the LP relaxation leans on).

    A module with more than :data:`DP_MAX_GROUPS` free op groups (a stage holding many blocks) is not given the
    dynamic programme when ``ratios`` are passed: its options are the exact knapsacks of :func:`select_ops` at
    those discard ratios (the trade-off's greedy vertices), and ``complete`` is False.
    """
    ops = tuple(ops)
    A = int(max_discard_bytes)
    R = float(full_recompute_ms)
    stop = (max((op.index for op in ops), default=-1) + 1) if recompute_stop is None else int(recompute_stop)
    complete = True
    sels: list[OpSelection] = []
    slacks: dict[OpSelection, float] = {}
    saved_groups, free, _ = _split(ops, False, stop)
    # The plain full checkpoint saves only what is forced (in-place writes to outside tensors) and recomputes
    # every other op before the stop, free ones included (as apply_plan does): its cost may exceed R.
    forced = {p for g in saved_groups if g.fixed == 1 for p in g.members}
    q_full = _result(ops, forced, stop, False).recompute_ms / R if R > 0 else 1.0
    pts: list[tuple[float, float, OpSelection | None]] = [(1.0, max(1.0, q_full), None)]
    if A > 0 and R > 0:
        if len(free) <= DP_MAX_GROUPS or not ratios:
            # Every front point is priced from the DP's own sums and only the points that survive the pruning
            # below are realised as selections (a Llama-family root's front has ~5,000 points, 16 are kept).
            front, complete = _front(free, FRONT_CAP)
            always = {p for g in saved_groups for p in g.members}
            always_bytes = sum(max(0, int(ops[p].save_cost_bytes)) for p in always)
            # recompute ms priced exactly as a realised selection is (math.fsum of the recomputed ops): fsum is
            # exact over its inputs, so the exact partials of every op's ms less the saved groups' ms give it
            base = _partials([op.runtime_ms for p, op in enumerate(ops) if p not in always and op.index < stop])
            terms = [[-ops[p].runtime_ms for p in g.members if ops[p].index < stop] for g in free]
            for b, _, mask in front:
                d = A - (always_bytes + b)
                if d < 0:
                    continue
                xs, rest = list(base), mask
                while rest:
                    low = rest & -rest
                    xs.extend(terms[low.bit_length() - 1])
                    rest ^= low
                pts.append((min(1.0, d / A), min(1.0, math.fsum(xs) / R), _Pending(mask, bool(always) or mask != 0)))
        else:  # a large module (a stage of many blocks): exact knapsacks at the sampled ratios only
            complete = False
            fill = _Greedy(ops, saved_groups, free, stop)
            for r in sorted(set(float(min(1.0, max(0.0, x))) for x in ratios)):
                cap = max(0, min(A, int(round(A * (1.0 - r)))))
                try:
                    sel, sl = fill(cap)
                    if sl > 0 and not limits.expired():  # fractional: the exact knapsack (past the time budget
                        sel, sl = _knapsack(ops, saved_groups, free, cap, solver, stop)  # the fill, within sl)
                except InfeasibleBudgetError:
                    continue
                sels.append(sel)
                slacks[sel] = max(slacks.get(sel, 0.0), sl)
    for sel in sels:
        d = A - sel.saved_bytes
        if d >= 0:
            pts.append((min(1.0, d / A), min(1.0, sel.recompute_ms / R), sel))
    # Pareto front: by ratio descending, keep strictly cheaper options. On a tie a save list beats the plain full
    # checkpoint: it names the free ops (the module's output op) that a full checkpoint would recompute; an
    # empty save list is the full checkpoint itself.
    pts.sort(key=lambda p: (-p[0], p[1], 1 if p[2] is None else (0 if p[2].saved else 2)))
    kept: list[tuple[float, float, OpSelection | None]] = []
    for p in pts:
        if not kept or p[1] < kept[-1][1] - 1e-12:
            if kept and abs(p[0] - kept[-1][0]) <= 1e-15:
                continue
            kept.append(p)
    kept.reverse()
    if max_options is not None and len(kept) > max(2, max_options):
        complete = False
        kept = [kept[k] for k in thin_front([(p[0], p[1]) for p in kept], max(2, max_options))]
    if any(isinstance(p[2], _Pending) for p in kept):
        kept = _realise(ops, kept, saved_groups, free, stop, A, R)
    slack = max([0.0] + [slacks.get(p[2], 0.0) for p in kept if p[2] is not None])
    return ModuleOptions(
        ratio=tuple(p[0] for p in kept),
        frac=tuple(p[1] for p in kept),
        selection=tuple(p[2] for p in kept),
        complete=complete,
        slack_frac=min(1.0, slack / R) if R > 0 else 0.0,
    )


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
    keep = np.zeros(len(m), dtype=bool)
    best = -math.inf
    for i, v in enumerate(m.tolist()):
        if best == -math.inf or v > best + 1e-12 * max(1.0, abs(best)):
            keep[i] = True
            best = v
    return keep


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
    ops: Sequence[OpStat], kept: list, saved_groups: Sequence[_Group], free: Sequence[_Group], stop: int, A: int, R: float
) -> list[tuple[float, float, OpSelection | None]]:
    """The kept options with their selections built and priced exactly (``math.fsum`` over the recomputed ops, as
    every selection is); an option the exact prices show dominated (equal ratio or no cheaper, at 1e-12) goes."""
    always = {p for g in saved_groups for p in g.members}
    out: list[tuple[float, float, OpSelection | None]] = []
    for r, q, sel in kept:
        if isinstance(sel, _Pending):
            saved = set(always)
            for i, g in enumerate(free):
                if sel.mask >> i & 1:
                    saved.update(g.members)
            sel = _result(ops, saved, stop, False)
            r, q = min(1.0, (A - sel.saved_bytes) / A), min(1.0, sel.recompute_ms / R)
        out.append((r, q, sel))
    res: list[tuple[float, float, OpSelection | None]] = []
    for p in sorted(out, key=lambda p: (-p[0], p[1])):  # ratio descending: keep strictly cheaper ones
        if not res or (p[1] < res[-1][1] - 1e-12 and abs(p[0] - res[-1][0]) > 1e-15):
            res.append(p)
    res.reverse()
    return res


def thin_front(pts: Sequence[tuple[float, float]], keep: int) -> list[int]:
    """Indices of the ``keep`` points of a front (sorted by ratio ascending) that :func:`module_options` keeps.

    Interior points are dropped one at a time, the one whose removal costs least first -- loss
    ``(q_next - q_k) · (r_k - r_prev)`` with its *current* neighbours, vertices of the lower convex hull last,
    ties to the lowest index -- until ``keep`` remain; the end points always stay. A heap with lazy deletion
    over a linked list: only the two neighbours' losses change at each drop, so O(n log n) (the same choices,
    in the same order, as re-scanning the front at each drop, which was O(n²): a 19,365-point front took
    ~100 s).
    """
    n = len(pts)
    keep = max(2, int(keep))
    if n <= keep:
        return list(range(n))
    hull = _hull_indices(pts)
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


def _hull_indices(pts: Sequence[tuple[float, float]]) -> set[int]:
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
    always, free, never = _split(ops, False, stop)
    forced = sum(g.bytes for g in always)
    base_ms = sum(g.ms for g in never)  # always recomputed (views, or nothing to gain by saving)
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
    pts = sorted(set(pts))
    hull = [pts[i] for i in sorted(_hull_indices(pts))]
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
