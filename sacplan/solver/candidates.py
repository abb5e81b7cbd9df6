"""Checkpoint candidates (:class:`Candidate`): which modules of a tree the MILP may checkpoint
(:func:`select_candidates`) and what each one costs to recompute (trade-off lines, :func:`envelope`; their LP
relaxation in lower-bound mode, :func:`relaxed_candidate`)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from sacplan.devices import checkpoint_state_bytes
from sacplan.errors import ConfigError
from sacplan.solver.ops import fractional_lines
from sacplan.stats import ModuleStats
from sacplan.tree import ModuleTree


@dataclass(frozen=True)
class Candidate:
    """A module the MILP may checkpoint (``slot`` = its position among candidates, pre-order)."""

    slot: int
    node: int
    fqn: str
    calls: int
    max_discard_bytes: int  # A (one call, the trade-off's)
    act_bytes: tuple[int, ...]  # A_{i,c} per call
    recompute_ms: float  # R (one call)
    slopes: tuple[float, ...]
    intercepts: tuple[float, ...]
    parent_slot: int  # nearest candidate ancestor, -1 if none
    has_child: bool  # some candidate lies below it
    #: bytes each call keeps only because it is checkpointed (stashed RNG state, inputs nothing else saves)
    overhead_bytes: tuple[float, ...] = ()
    #: smallest discard ratio at which no call keeps more than it frees (``r >= min_ratio`` when checkpointed)
    min_ratio: float = 0.0
    #: per call, bytes of its discard that autocast's weight cache holds until autocast exits
    #: (:attr:`~sacplan.stats.ModuleStats.cache_held`): kept at the forward events only (empty: none)
    cache_held_bytes: tuple[float, ...] = ()

    def fw_overhead(self, call: int) -> float:
        """Bytes call ``call`` keeps at the forward events after its forward when checkpointed: its overhead plus
        the cached parameter casts its discard cannot free before autocast exits."""
        ch = self.cache_held_bytes
        return self.overhead_bytes[call] + (ch[call] if call < len(ch) else 0.0)

    def fraction(self, r: float, y: float = 1.0) -> float:
        """Recompute fraction of one call by the lines: ``max(0, max_s(slope_s·r + intercept_s·y))``."""
        return max([0.0] + [s * r + b * y for s, b in zip(self.slopes, self.intercepts)])

    def cost(self, r: float, y: float = 1.0) -> float:
        """MILP recompute ms over all calls: ``calls · R ·`` :meth:`fraction` (0 when not checkpointed)."""
        if y <= 0:
            return 0.0
        return self.calls * self.recompute_ms * self.fraction(r, y)


def select_candidates(
    tree: ModuleTree, ac_units: Sequence[str] | None, fsdp_units: Sequence[str] | None
) -> tuple[list[Candidate], list[str]]:
    """The modules of ``tree`` the MILP may checkpoint, in pre-order (slot = position), and notes (warnings) on named
    ``ac_units`` that cannot be. ``ac_units``: allowed units (None: every eligible module but the root);
    ``fsdp_units``: no unit may be an ancestor of one."""
    if isinstance(ac_units, str) or isinstance(fsdp_units, str):
        raise ConfigError("ac_units / fsdp_units must be lists of module names, not a single string")
    post_calls: dict[str, int] = {}
    for f in tree.stats.fw_post_order:
        post_calls[f] = post_calls.get(f, 0) + 1
    chosen, overheads, notes = _eligible(tree, ac_units, fsdp_units, post_calls)
    parents, has_child = _nesting(tree, chosen)
    out = []
    for s, ni in enumerate(chosen):
        n = tree.nodes[ni]
        t = n.stats.tradeoff
        assert t is not None
        calls = post_calls[n.fqn]
        if not t.slopes or len(t.slopes) != len(t.intercepts):
            raise ConfigError(
                f"module {n.fqn!r}: its trade-off needs as many slopes as intercepts (and at least one line)"
            )
        env = envelope(t.slopes, t.intercepts)
        act = _act_per_call(n.stats, calls)
        over, cached, min_ratio = overheads[ni]
        out.append(
            Candidate(
                slot=s,
                node=ni,
                fqn=n.fqn,
                calls=calls,
                max_discard_bytes=int(t.max_discard_bytes),
                act_bytes=act,
                recompute_ms=float(t.full_recompute_ms),
                slopes=env[0],
                intercepts=env[1],
                parent_slot=parents[s],
                has_child=has_child[s],
                overhead_bytes=over,
                min_ratio=min_ratio,
                cache_held_bytes=cached,
            )
        )
    return out, notes


def _eligible(
    tree: ModuleTree, ac_units: Sequence[str] | None, fsdp_units: Sequence[str] | None, post_calls: dict[str, int],
) -> tuple[list[int], dict[int, tuple[tuple[float, ...], tuple[float, ...], float]], list[str]]:
    """(node indices that may be checkpoint units in pre-order, their per-call overheads, cached casts and minimum
    ratios, notes on named ``ac_units`` that cannot be)."""
    notes: list[str] = []
    named = None
    if ac_units is not None:
        named = {tree.node(f).index for f in ac_units}  # ConfigError with suggestions if unknown
    blocked: set[int] = set()
    for f in fsdp_units or ():
        for a in tree.ancestors(f):  # ConfigError with suggestions if unknown
            blocked.add(a.index)
    chosen: list[int] = []
    overheads: dict[int, tuple[tuple[float, ...], tuple[float, ...], float]] = {}
    for n in tree.nodes:
        t = n.stats.tradeoff
        if named is not None and n.index not in named:
            continue
        eligible = t is not None and t.max_discard_bytes > 0 and post_calls.get(n.fqn, 0) > 0
        if named is None and n.parent is None:
            # the root only when named explicitly. Leaves are candidates: checkpointing a norm layer alone
            # (recompute a few pointwise ops, drop its fp32 intermediates) is what makes a third of full
            # AC's recompute reachable at full AC's peak on Llama-7B (15.9% with leaves, 33.4% without).
            eligible = False
        if n.index in blocked:
            if named is not None and eligible:
                notes.append(
                    f"ac unit {n.fqn!r} is an ancestor of an FSDP unit and cannot be checkpointed"
                )
            continue
        if not eligible:
            if named is not None:
                notes.append(f"ac unit {n.fqn!r} has no discardable activations and is skipped")
            continue
        ck = float(checkpoint_state_bytes(tree.stats.device, n.stats.draws_random))
        overheads[n.index] = _overheads(n.stats, post_calls[n.fqn], ck)
        if overheads[n.index][2] > 1.0:
            if named is not None:
                notes.append(
                    f"ac unit {n.fqn!r} would keep more bytes checkpointed (inputs held until its backward, "
                    "stashed RNG state, parameter casts autocast caches) than it can discard, and is skipped"
                )
            continue
        chosen.append(n.index)
    return chosen, overheads, notes


def _nesting(tree: ModuleTree, chosen: list[int]) -> tuple[list[int], list[bool]]:
    """Per chosen node, the slot of its nearest chosen ancestor (-1: none), and whether a chosen node nests in it."""
    slot_of = {ni: s for s, ni in enumerate(chosen)}
    has_child = [False] * len(chosen)
    parents = []
    for ni in chosen:
        p = tree.nodes[ni].parent
        while p is not None and p not in slot_of:
            p = tree.nodes[p].parent
        ps = -1 if p is None else slot_of[p]
        parents.append(ps)
        if ps >= 0:
            has_child[ps] = True
    return parents, has_child


def _overheads(
    ms: ModuleStats, calls: int, ck_overhead: float
) -> tuple[tuple[float, ...], tuple[float, ...], float]:
    """Per call, the bytes checkpointing keeps besides saved tensors (``ck_overhead``, the stashed RNG state of
    :func:`~sacplan.devices.checkpoint_state_bytes`, plus :attr:`~sacplan.stats.ModuleStats.held_input_bytes`), the
    bytes of its discard autocast's cache keeps at the forward events (:attr:`~sacplan.stats.ModuleStats.cache_held`;
    ``()`` when none), and the smallest discard ratio at which every call frees at least the larger of the two
    overheads (the forward one): only ratios above it are offered, which cuts off dominated choices only and keeps
    both running sums of discards monotone (what lets :mod:`sacplan.solver.formulation` drop dominated events)."""
    held, ch = ms.held_input_bytes, ms.cache_held
    over = tuple(ck_overhead + float(held[c] if c < len(held) else 0) for c in range(calls))
    cached = tuple(float(ch[c] if c < len(ch) else 0) for c in range(calls)) if any(ch) else ()
    fw_over = [o + (cached[c] if cached else 0.0) for c, o in enumerate(over)]
    acts = _act_per_call(ms, calls)
    # a call that frees nothing but keeps overhead (a module called twice, one call keeping no activations)
    # has no useful ratio: infinity, so the module is skipped as keeping more than it frees
    ratios = [(o / a if a > 0 else float("inf")) if o > 0 else 0.0 for a, o in zip(acts, fw_over)]
    return over, cached, max(ratios, default=0.0)


def _act_per_call(ms: ModuleStats, calls: int) -> tuple[int, ...]:
    """Discardable bytes per call ``A_{i,c}`` (a call past those collected: the last one's; none collected: the
    trade-off's ``A``)."""
    assert ms.tradeoff is not None
    act = tuple(int(a) for a in ms.act_bytes) or (int(ms.tradeoff.max_discard_bytes),)
    return tuple(act[c] if c < len(act) else act[-1] for c in range(calls))


def relaxed_candidate(tree: ModuleTree, c: Candidate) -> Candidate:
    """``c`` with its cost lines replaced by the LP relaxation of its op-level knapsack (below every achievable
    option: the lower-bound mode of :class:`~sacplan.solver.problem.SacProblem`); ``c`` itself without ops."""
    st = tree.nodes[c.node].stats
    if not st.ops or c.recompute_ms <= 0:
        return c
    sl, ic = fractional_lines(st.ops, c.max_discard_bytes, c.recompute_ms, recompute_stop=st.recompute_stop)
    env = envelope(sl, ic)
    return dataclasses.replace(c, slopes=env[0], intercepts=env[1])


def envelope(slopes: Sequence[float], intercepts: Sequence[float]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The lines of ``max(0, max_s(slope_s·r + intercept_s))`` maximal somewhere on ``r ∈ [0, 1]``, by slope (at
    least one). The perspective ``q ≥ slope·r + intercept·y`` of a line dominated on [0, 1] is dominated for every
    ``0 ≤ r ≤ y``: it adds a row but no strength. Memoised (repeated blocks)."""
    return _envelope(tuple(float(a) for a in slopes), tuple(float(b) for b in intercepts))


@functools.lru_cache(maxsize=4096)
def _envelope(slopes: tuple[float, ...], intercepts: tuple[float, ...]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    # merge lines equal up to rounding noise into one that bounds both (so q stays an upper bound)
    lines: list[tuple[float, float]] = []
    for sl, ic in sorted(set(zip(slopes, intercepts))):
        if lines and abs(sl - lines[-1][0]) <= 1e-12 * max(1.0, abs(sl)) and abs(ic - lines[-1][1]) <= 1e-12 * max(1.0, abs(ic)):
            lines[-1] = (max(sl, lines[-1][0]), max(ic, lines[-1][1]))
        else:
            lines.append((sl, ic))
    a = np.array([l[0] for l in lines])
    b = np.array([l[1] for l in lines])
    # candidate abscissae: 0, 1, pairwise crossings and zero crossings inside (0, 1), plus midpoints
    with np.errstate(divide="ignore", invalid="ignore"):
        cross = ((b[None, :] - b[:, None]) / (a[:, None] - a[None, :])).ravel()
        zeros = -b / a
    pts = np.concatenate([[0.0, 1.0], cross, zeros])
    pts = np.unique(pts[np.isfinite(pts) & (pts > 0.0) & (pts < 1.0)].tolist() + [0.0, 1.0])
    xs = np.concatenate([pts, (pts[:-1] + pts[1:]) / 2])
    vals = a[None, :] * xs[:, None] + b[None, :]  # (points, lines)
    best = vals.max(axis=1)
    keep: set[int] = set()
    for k, x in enumerate(xs):
        if best[k] <= 1e-15:
            continue  # q >= 0 is active here
        tol = 1e-12 * max(1.0, abs(best[k]))
        winners = np.nonzero(vals[k] >= best[k] - tol)[0]
        # on ties keep the lines that stay maximal to the right (largest slope) and to the left (smallest)
        keep.add(int(winners[-1]) if x < 1.0 else int(winners[0]))
        keep.add(int(winners[0]) if x > 0.0 else int(winners[-1]))
    if not keep:
        keep = {int(np.argmax(a + b))}
    kept = [lines[i] for i in sorted(keep)]
    return tuple(x for x, _ in kept), tuple(y for _, y in kept)
