"""Evaluate any checkpointing choice on a :class:`~sacplan.tree.ModuleTree` with sacplan's memory model.

The memory model the solver constrains (:mod:`sacplan.timeline`) is computed here for a *given*
choice — a solver plan, full checkpointing of every block, a fixed op save-list, PyTorch's reference plan —
so every alternative is judged by one model, and a plan made on one host can be re-evaluated on stats
collected on another (ops are matched by ``(family, occurrence)``, see :mod:`sacplan.opnames`).

The memory model itself (events, running sums, what a checkpointed call keeps) lives in
:mod:`sacplan.timeline`; this module turns a choice into per-call discards, recompute time and FLOPs
(:func:`module_outcome`) and asks the timeline for the peaks (:func:`event_peaks`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

from sacplan.devices import DeviceSpec, checkpoint_state_bytes
from sacplan.opgroups import forced_saves, named_saves, op_groups, stop_index
from sacplan.opnames import op_keys
from sacplan.sacmode import region_dispatch_ms
from sacplan.stats import ModuleStats, OpStat
from sacplan.timeline import RC, Timeline
from sacplan.tradeoff import greedy_vertices, recompute_surge
from sacplan.tree import ModuleTree

#: A choice for one module: ``None`` = full checkpointing (save nothing but what must be saved);
#: otherwise the ``(family, occurrence)`` keys of the ops to save.
Choice = frozenset | None


@dataclass(frozen=True)
class ModuleOutcome:
    """What one checkpointed module costs and frees under a choice (per call lists; totals over calls)."""

    fqn: str
    discard_bytes: tuple[int, ...]
    recompute_ms: float
    recompute_flops: int
    saved_keys: frozenset
    #: bytes each recomputation peaks above the call's forward peak (:func:`~sacplan.tradeoff.recompute_surge`)
    surge_bytes: int = 0
    #: host ms over all calls that the selective-checkpoint mode adds (:mod:`sacplan.sacmode`; 0 for a plain region)
    dispatch_ms: float = 0.0


@dataclass(frozen=True)
class Prediction:
    """Predicted memory and recompute of a choice.

    Attributes:
        peak_bytes: predicted step peak (bytes, per rank).
        baseline_peak_bytes: the same model's peak without checkpointing.
        recompute_ms: total recompute time on the tree's target device.
        recompute_flops: total recomputed FLOPs (what ``FlopCounterMode`` would count extra).
        dispatch_ms: host ms the selective-checkpoint mode adds over all regions (:mod:`sacplan.sacmode`).
        peak_event: index of the event at the peak.
        modules: per checkpointed module.
    """

    peak_bytes: int
    baseline_peak_bytes: int
    recompute_ms: float
    recompute_flops: int
    peak_event: int
    modules: tuple[ModuleOutcome, ...] = field(default_factory=tuple)
    dispatch_ms: float = 0.0


def module_outcome(stats: ModuleStats, choice: Choice, device: DeviceSpec | None = None) -> ModuleOutcome:
    """Discarded bytes (per call) and recompute cost of checkpointing ``stats`` with ``choice``.

    Groups (:func:`~sacplan.opgroups.op_groups`: in-place chains, random ops) are saved whole if any member is
    named, except groups holding a view, which are always recomputed; ops that must be
    saved (in-place on a tensor from outside the module) are always kept, and so are ops that cost nothing
    to save when ``choice`` is a save list. A full checkpoint (``choice=None``) saves nothing else: its
    recomputation re-runs every op before the early stop, free ones included (as ``apply_plan`` does).
    ``device``: the target whose selective mode's dispatch a save list (or a full checkpoint that still runs
    selective, :func:`~sacplan.sacmode.full_runs_selective`) pays (None: not counted).
    """
    ops = stats.ops
    keys = op_keys(ops)
    stop = stop_index(ops, stats.recompute_stop)
    raw = _raw_kept(stats)
    saved_pos: set[int] = set()
    for g in op_groups(ops, False, stop):
        if g.fixed == 0:
            continue  # views, and what is tied to them: always recomputed
        named = choice is not None and any(keys[i] in choice for i in g.members)
        if g.fixed == 1 or named or (g.bytes == 0 and choice is not None):
            saved_pos.update(g.members)
    kept = sum(ops[i].save_cost_bytes for i in saved_pos)
    ms = sum(o.runtime_ms for o in ops if o.index < stop and o.index not in saved_pos)
    flops = sum(o.flops for o in ops if o.index < stop and o.index not in saved_pos)
    discards = []
    for c in range(stats.calls):
        a_c = raw[c]
        discards.append(max(0, a_c - kept) if a_c > 0 else 0)
    return ModuleOutcome(
        fqn=stats.fqn,
        discard_bytes=tuple(discards),
        recompute_ms=ms * stats.calls,
        recompute_flops=flops * stats.calls,
        saved_keys=frozenset(keys[i] for i in saved_pos),
        surge_bytes=recompute_surge(ops, saved_pos, stop),
        dispatch_ms=_dispatch(stats, choice, device),
    )


def _dispatch(stats: ModuleStats, choice: Choice, device: DeviceSpec | None) -> float:
    """Host ms over all calls the selective mode adds to the region (0 without a device): for the ops the plan of
    ``choice`` saves (:func:`~sacplan.opgroups.named_saves`, or :func:`~sacplan.opgroups.forced_saves` for a full
    checkpoint), as :func:`sacplan.alternatives.plan_from_choices` writes them."""
    if device is None:
        return 0.0
    stop = stats.recompute_stop
    saves = forced_saves(stats.ops, stop) if choice is None else named_saves(stats.ops, stop, choice)
    return stats.calls * region_dispatch_ms(stats, device, saves)


def _raw_kept(stats: ModuleStats) -> list[int]:
    """Activation bytes each call keeps without checkpointing (``act_bytes`` is that minus mandatory saves)."""
    if stats.tradeoff is None:
        return [0] * stats.calls
    _, mandatory = greedy_vertices(stats.ops, 0, stats.recompute_stop)
    return [a + mandatory if a > 0 else 0 for a in stats.act_bytes]


def rng_copy_bytes(tree: ModuleTree, fqn: str) -> int:
    """Bytes checkpointed module ``fqn`` adds at its rc events besides its recompute transient: the RNG state
    ``torch.utils.checkpoint`` copies (``torch.random.fork_rng``) for the length of a recomputation that replays
    the forward's random numbers, :func:`~sacplan.devices.checkpoint_state_bytes` of the target (0 for a region
    that draws none, which keeps no state, and on a GPU target).

    Added on top of the rc event's value, which bounds the recomputation from above (every discarded tensor back
    plus the transient) but also covers the stretch before it (the backward that precedes the recomputation): where
    that stretch holds the event's peak, the copy is counted where it does not overlap (an over-prediction of at
    most these bytes, never an under-prediction). The solver adds the same bytes
    (:class:`~sacplan.solver.problem.SacProblem`).
    """
    return checkpoint_state_bytes(tree.stats.device, tree.node(fqn).stats.draws_random)


def event_peaks(
    tree: ModuleTree,
    discards: Mapping[str, Sequence[int]],
    world_size: int | None = None,
    surges: Mapping[str, int] | None = None,
    timeline: Timeline | None = None,
) -> list[int]:
    """Predicted bytes at every event of the step's timeline (:class:`~sacplan.timeline.Timeline`) for per-call
    ``discards`` (fqn → bytes per call), rounded up to whole bytes.

    Every module in ``discards`` is checkpointed: each of its calls also keeps
    :func:`~sacplan.devices.checkpoint_state_bytes` (the stashed RNG state when the target is the host CPU and the
    module draws random numbers)
    and its :attr:`~sacplan.stats.ModuleStats.held_input_bytes` (inputs the checkpoint holds), from its forward
    to the end of its backward (:meth:`~sacplan.stats.ModelStats.backward_active`), and at the forward events after
    its forward the parameter casts autocast's weight cache holds until autocast exits
    (:attr:`~sacplan.stats.ModuleStats.cache_held`: its discard frees them for the backward only); at its rc events the
    recompute transient (``extra_bytes``) plus ``surges[fqn]`` (bytes a selective recomputation peaks above
    the forward, :attr:`ModuleOutcome.surge_bytes`) plus, for a region that keeps the RNG state, the copy of it
    ``torch.random.fork_rng`` holds while the region is recomputed (:func:`rng_copy_bytes`). ``timeline``: ``Timeline.of(tree.stats, world_size)`` when
    the caller has it already.
    """
    tl = Timeline.of(tree.stats, world_size) if timeline is None else timeline
    surges = surges or {}
    rng_state = {fqn: rng_copy_bytes(tree, fqn) for fqn in discards}  # the stash per call, and its copy at rc

    def kept(fqn: str, call: int) -> int:
        held = tree.node(fqn).stats.held_input_bytes
        return rng_state[fqn] + (held[call] if call < len(held) else 0)

    def cached(fqn: str, call: int) -> int:
        ch = tree.node(fqn).stats.cache_held
        return ch[call] if call < len(ch) else 0

    def freed(entries: Sequence[tuple[str, int]], forward: bool) -> np.ndarray:
        out = np.zeros(len(entries))
        for k, (fqn, c) in enumerate(entries):
            d = discards.get(fqn)
            if d is not None and c < len(d):
                out[k] = d[c] - kept(fqn, c) - (cached(fqn, c) if forward else 0)
        return out

    bw_kept = np.asarray([kept(f, c) if f in discards else 0 for f, c in tl.bw_entries], dtype=float)
    added = tl.held(bw_kept)
    for i, (ph, fqn) in enumerate(zip(tl.phase, tl.module)):
        if ph == RC and fqn in discards:
            added[i] += tl.extra[i] + surges.get(fqn, 0) + rng_state[fqn]
    peaks = tl.peaks(freed(tl.fw_entries, True), freed(tl.bw_entries, False), added)
    return [int(math.ceil(m - 1e-6)) for m in peaks]


def predict(
    tree: ModuleTree, choices: Mapping[str, Choice], world_size: int | None = None
) -> Prediction:
    """Predicted peak and recompute of checkpointing the modules in ``choices`` (fqn → :data:`Choice`)."""
    outcomes = []
    for fqn, choice in sorted(choices.items(), key=lambda kv: tree.index_of(kv[0])):
        outcomes.append(module_outcome(tree.node(fqn).stats, choice, tree.stats.device))
    discards = {o.fqn: o.discard_bytes for o in outcomes}
    tl = Timeline.of(tree.stats, world_size)
    peaks = event_peaks(tree, discards, world_size, {o.fqn: o.surge_bytes for o in outcomes}, timeline=tl)
    i = max(range(len(peaks)), key=peaks.__getitem__) if peaks else 0
    return Prediction(
        peak_bytes=peaks[i] if peaks else 0,
        baseline_peak_bytes=int(math.ceil(float(tl.base.max()) - 1e-6)) if tl.num_events else 0,
        recompute_ms=sum(o.recompute_ms for o in outcomes),
        recompute_flops=sum(o.recompute_flops for o in outcomes),
        peak_event=i,
        modules=tuple(outcomes),
        dispatch_ms=sum(o.dispatch_ms for o in outcomes),
    )


def full_choices(fqns: Iterable[str]) -> dict[str, Choice]:
    """Full checkpointing of each module in ``fqns``."""
    return {f: None for f in fqns}


def save_list_choices(tree: ModuleTree, fqns: Iterable[str], save_families: Iterable[str]) -> dict[str, Choice]:
    """For each module, save every op whose family is in ``save_families`` (e.g. matmuls and attention)."""
    fams = set(save_families)
    out: dict[str, Choice] = {}
    for f in fqns:
        ops: Sequence[OpStat] = tree.node(f).stats.ops
        out[f] = frozenset(k for k in op_keys(ops) if k[0] in fams)
    return out
