"""Op groups of one module: the forward ops a save list decides together, and whether it must save them, may
choose, or never saves them. The one home of that rule: the trade-off curve (:mod:`sacplan.tradeoff`), the
evaluation of a given save list (:mod:`sacplan.evaluate`) and the solver's knapsacks (:mod:`sacplan.solver.ops`,
:mod:`sacplan.solver.front`, :mod:`sacplan.solver.knapsack`) all read it from here.

* view ops are always recomputed: they are free and hold no storage of their own;
* an in-place op is decided together with the op whose output it modifies; a group whose head is itself in-place
  with no producer inside the module is saved (its input cannot be recomputed inside the module);
* random ops are all saved or all recomputed together (or all saved with ``force_store_random``), so a
  recomputation never redraws some random numbers and reuses others;
* an op that reads a storage an in-place op overwrites later is decided together with that storage
  (:attr:`~sacplan.stats.OpStat.tied_to`), or always saved when the storage comes from outside the module: a
  saved storage is cached with its *final* value, so a recomputed reader would compute from the overwritten
  one and change the gradients silently (:mod:`sacplan.collector.mutations` derives the ties and proves the
  rule). Every save list built from these groups therefore gives the unplanned step's gradients.
* an op making the module's output that only later modules' backwards read
  (:attr:`~sacplan.stats.OpStat.output_kept_outside`) is never saved, with its group. Saving it looks free
  (the output is live anyway), but the unplanned step frees the output once those later backwards are done,
  before this module's backward starts, while a selective cache holding it keeps it through the module's
  recomputation and backward: one output more at the events between, which no save list may cost without the
  memory model seeing it (measured: +8.4% on an RMSNorm → in-place-residual region, tests/fuzz/test_regressions.py
  ``test_rmsnorm_then_inplace_saved_mutations_peak``). Recomputed instead, the output is re-made by the
  recomputation (its transient, which the model counts) and freed after it. An output that the module's own
  backward reads stays free to save: the unplanned step holds it into that backward too.

* a parameter's cast that autocast's weight cache keeps (:attr:`~sacplan.stats.OpStat.cached_cast`) is never
  saved, with its group. In the forward the cache holds it whatever the plan; the memory model credits a
  checkpointed call's discard of it at backward events only (:attr:`~sacplan.stats.ModuleStats.cache_held`), so
  a save list keeping it would be counted twice at the forward events (measured: -3.3% on a tied-weight model
  under CPU bf16 autocast). Recomputed instead, it is cast again in the recomputation (cheap).

The tied ops are merged into :class:`OpGroup` s first (union-find, :func:`op_groups`); :func:`split_groups` sorts
them into always saved, free and never saved. The free groups are the items of the knapsacks of
:mod:`sacplan.solver.knapsack` (one byte budget) and :mod:`sacplan.solver.front` (every budget at once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Sequence

from sacplan.opnames import op_keys
from sacplan.stats import OpStat


@dataclass(frozen=True)
class OpGroup:
    """Ops decided together: their positions in the op sequence, saved bytes, recompute ms and FLOPs (ops
    before ``recompute_stop`` only) and whether the choice is forced (0: always recomputed, 1: always saved)."""

    members: tuple[int, ...]  # positions in the op sequence, ascending
    bytes: int
    ms: float
    fixed: int | None  # 0 / 1 when forced, None when free
    flops: int = 0


def stop_index(ops: Sequence[OpStat], recompute_stop: int | None) -> int:
    """Index of the first op a recomputation of ``ops`` never re-runs: ``recompute_stop``, or (None: no stop)
    one past the last op."""
    return (max((op.index for op in ops), default=-1) + 1) if recompute_stop is None else int(recompute_stop)


def op_groups(ops: Sequence[OpStat], force_store_random: bool, recompute_stop: int | None) -> list[OpGroup]:
    """Every group of ``ops`` (in order of their first op), forced or free; see the module docstring. Their ms and
    FLOPs count the ops before ``recompute_stop`` (None: every op, :func:`stop_index`)."""
    stop = stop_index(ops, recompute_stop)
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
    for p, op in enumerate(ops):
        for t in op.tied_to:
            q = pos.get(t) if t >= 0 else None
            if q is None:
                forced_save[p] = True  # reads an outside storage overwritten later: recomputing it reads the new value
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
        elif any(ops[p].output_kept_outside for p in ms) and not any(forced_save[p] for p in ms):
            fixed = 0  # the cache would hold the output past its death (module docstring)
        elif any(ops[p].cached_cast for p in ms) and not any(forced_save[p] for p in ms):
            fixed = 0  # autocast's cache holds it through the forward anyway (module docstring)
        elif any(forced_save[p] for p in ms):
            fixed = 1
        else:
            fixed = None
        out.append(
            OpGroup(
                members=tuple(ms),
                bytes=sum(max(0, int(ops[p].save_cost_bytes)) for p in ms),
                ms=sum(float(ops[p].runtime_ms) for p in ms if ops[p].index < stop),
                fixed=fixed,
                flops=sum(int(ops[p].flops) for p in ms if ops[p].index < stop),
            )
        )
    return out


def split_groups(
    ops: Sequence[OpStat], force_store_random: bool, stop: int | None
) -> tuple[list[OpGroup], list[OpGroup], list[OpGroup]]:
    """The groups as every selection treats them: ``(always saved, free to choose, never saved)``.

    Always saved: forced ones (in-place on outside inputs, random with ``force_store_random``) and those that
    cost no bytes yet save time. Never saved: views (and what is tied to them) and groups that save no time.
    Free: the rest — the knapsack items."""
    always, free, never = [], [], []
    for g in op_groups(ops, force_store_random, stop):
        if g.fixed == 1 or (g.fixed is None and g.bytes == 0 and g.ms > 0.0):
            always.append(g)
        elif g.fixed is None and g.ms > 0.0:
            free.append(g)
        else:
            never.append(g)
    return always, free, never


def fill_order(free: Sequence[OpGroup]) -> list[int]:
    """The greedy fill's order of the free groups (indices into ``free``): fewest bytes per ms (most ms per byte)
    first; ties: the later group first. The one greedy order: saving a prefix of it is the knapsack's LP relaxation
    at that prefix's bytes (:class:`~sacplan.solver.knapsack.GreedyFill`), and giving it up from its end (most bytes
    per ms first, ties: the earlier group first) traces the trade-off's greedy vertices
    (:func:`~sacplan.tradeoff.greedy_vertices`), so every vertex is a fill that ends on a whole group."""
    return sorted(range(len(free)), key=lambda i: (-free[i].bytes / free[i].ms, free[i].members[0]))[::-1]


def forced_saves(ops: Sequence[OpStat], stop: int | None) -> tuple[tuple[int, str, int], ...] | None:
    """``(index, name, occurrence)`` of the ops every save list keeps, when a plain checkpoint would not keep
    them: ``None`` unless an op reads an outside storage that is overwritten later (``tied_to`` holds ``-1``).

    ``apply`` saves in-place writes into outside tensors by itself (they are found at run time), but not the
    ops that read such a tensor before it is overwritten, so a full checkpoint of such a module must name them.
    """
    return _saves(ops, op_groups(ops, False, stop), set()) if _has_forced_readers(ops) else None


def named_saves(
    ops: Sequence[OpStat], stop: int | None, keys: Collection[tuple[str, int]]
) -> tuple[tuple[int, str, int], ...]:
    """``(index, name, occurrence)`` of the ops a save list of ``(family, occurrence)`` keys saves: every group
    with a named member, whole (a group saved in part is not safe), and :func:`forced_saves`; groups holding a
    view are never saved."""
    named = op_keys(ops)
    groups = op_groups(ops, False, stop)
    keep = {p for g in groups if g.fixed is None and any(named[p] in keys for p in g.members) for p in g.members}
    return _saves(ops, groups if _has_forced_readers(ops) else [], keep)


def _has_forced_readers(ops: Sequence[OpStat]) -> bool:
    return any(-1 in op.tied_to for op in ops)


def _saves(ops: Sequence[OpStat], groups: Sequence[OpGroup], keep: set[int]) -> tuple[tuple[int, str, int], ...]:
    """The keys of ``keep`` and of the always-saved groups among ``groups``, in op order."""
    keep = keep | {p for g in groups if g.fixed == 1 for p in g.members}
    return tuple((ops[p].index, ops[p].name, ops[p].occurrence) for p in sorted(keep))
