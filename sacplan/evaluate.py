"""Evaluate any checkpointing choice on a :class:`~sacplan.tree.ModuleTree` with sacplan's memory model.

The same formula the solver constrains (see :func:`sacplan.solve.solve`) is computed here for a *given*
choice — a solver plan, full checkpointing of every block, a fixed op save-list, PyTorch's reference plan —
so every alternative is judged by one model, and a plan made on one host can be re-evaluated on stats
collected on another (ops are matched by ``(family, occurrence)``, see :mod:`sacplan.opnames`).

For event ``e`` with baseline ``peak_e`` and sharded state ``S_e`` (params + grads + optimizer state,
removed ``(1 - 1/world_size)`` when FSDP shards them), and per-call discards ``d``:

* forward:   ``peak_e - S_e - F[fw_done_e]``               (discards of calls whose forward finished)
* backward:  ``peak_e - S_e - (D - B[bw_started_e])``       (discards not yet re-materialised)
* rc (backward start of call ``j``): the backward value plus ``extra_e`` if ``j`` is checkpointed
* other:     ``peak_e - S_e``

where each checkpointed call's discard is its saved-tensor bytes freed minus what checkpointing keeps:
:func:`~sacplan.devices.checkpoint_state_bytes` (the RNG state checkpoint stashes; host-CPU targets only) and
the call's :attr:`~sacplan.stats.ModuleStats.held_input_bytes` (inputs nothing saves, held for recompute), and
``F`` / ``B`` are running sums of ``d`` along ``fw_post_order`` / ``bw_pre_order`` and ``D`` their total.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from sacplan.devices import checkpoint_state_bytes
from sacplan.opnames import op_keys
from sacplan.stats import ModuleStats, OpStat, Phase
from sacplan.tradeoff import greedy_vertices, op_groups, recompute_surge
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


@dataclass(frozen=True)
class Prediction:
    """Predicted memory and recompute of a choice.

    Attributes:
        peak_bytes: predicted step peak (bytes, per rank).
        baseline_peak_bytes: the same model's peak without checkpointing.
        recompute_ms: total recompute time on the tree's target device.
        recompute_flops: total recomputed FLOPs (what ``FlopCounterMode`` would count extra).
        peak_event: index of the event at the peak.
        modules: per checkpointed module.
    """

    peak_bytes: int
    baseline_peak_bytes: int
    recompute_ms: float
    recompute_flops: int
    peak_event: int
    modules: tuple[ModuleOutcome, ...] = field(default_factory=tuple)


def module_outcome(stats: ModuleStats, choice: Choice) -> ModuleOutcome:
    """Discarded bytes (per call) and recompute cost of checkpointing ``stats`` with ``choice``.

    Groups (in-place chains, random ops) are saved whole if any member is named; ops that must be
    saved (in-place on a tensor from outside the module) are always kept, and so are ops that cost nothing
    to save when ``choice`` is a save list. A full checkpoint (``choice=None``) saves nothing else: its
    recomputation re-runs every op before the early stop, free ones included (as ``apply_plan`` does).
    """
    ops = stats.ops
    keys = op_keys(ops)
    stop = stats.recompute_stop
    raw = _raw_kept(stats)
    saved_pos: set[int] = set()
    for head, members in op_groups(ops).items():
        cost = sum(ops[i].save_cost_bytes for i in members)
        outside = any(ops[i].inplace_of == i for i in members)
        named = choice is not None and any(keys[i] in choice for i in members)
        if outside or named or (cost == 0 and choice is not None):
            saved_pos.update(members)
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
    )


def _raw_kept(stats: ModuleStats) -> list[int]:
    """Activation bytes each call keeps without checkpointing (``act_bytes`` is that minus mandatory saves)."""
    if stats.tradeoff is None:
        return [0] * stats.calls
    _, mandatory = greedy_vertices(stats.ops, 0, stats.recompute_stop)
    return [a + mandatory if a > 0 else 0 for a in stats.act_bytes]


def event_peaks(
    tree: ModuleTree,
    discards: Mapping[str, Sequence[int]],
    world_size: int | None = None,
    surges: Mapping[str, int] | None = None,
) -> list[int]:
    """Predicted bytes at every event of ``tree.stats.events`` for per-call ``discards`` (fqn → bytes per call).

    Every module in ``discards`` is checkpointed: each of its calls also keeps
    :func:`~sacplan.devices.checkpoint_state_bytes` (the stashed RNG state when the target is the host CPU)
    and its :attr:`~sacplan.stats.ModuleStats.held_input_bytes` (inputs the checkpoint holds), from its forward
    to the end of its backward (:meth:`~sacplan.stats.ModelStats.backward_active`); at its rc events the
    recompute transient (``extra_bytes``) plus ``surges[fqn]`` (bytes a selective recomputation peaks above
    the forward, :attr:`ModuleOutcome.surge_bytes`).
    """
    st = tree.stats
    surges = surges or {}
    ck = checkpoint_state_bytes(st.device)  # kept per checkpointed call besides saved tensors (CPU target)
    ws = world_size or st.world_size
    shard = 1.0 - st.world_size / ws if ws > st.world_size else 0.0

    def running(order: Sequence[str]) -> list[int]:
        seen: dict[str, int] = {}
        sums = [0]
        for fqn in order:
            c = seen.get(fqn, 0)
            seen[fqn] = c + 1
            d = discards.get(fqn)
            sums.append(sums[-1] + (d[c] - overhead(fqn, c) if d is not None and c < len(d) else 0))
        return sums

    def overhead(fqn: str, call: int) -> int:
        held = tree.node(fqn).stats.held_input_bytes
        return ck + (held[call] if call < len(held) else 0)

    F = running(st.fw_post_order)
    B = running(st.bw_pre_order)
    D = B[-1]
    # calls inside their backward keep their overhead until it ends (recomputed discards are back in ``base``)
    pre_call = []
    seen: dict[str, int] = {}
    for fqn in st.bw_pre_order:
        pre_call.append(seen.get(fqn, 0))
        seen[fqn] = pre_call[-1] + 1
    active = st.backward_active()
    out = []
    for e, act in zip(st.events, active):
        base = e.peak_bytes - int(e.state_bytes * shard)
        if e.phase == Phase.FW:
            m = base - F[min(e.fw_done, len(F) - 1)]
        elif e.phase in (Phase.BW, Phase.RC):
            m = base - (D - B[min(e.bw_started, len(B) - 1)])
            m += sum(overhead(st.bw_pre_order[p], pre_call[p]) for p in act if st.bw_pre_order[p] in discards)
            if e.phase == Phase.RC and e.module in discards:
                m += e.extra_bytes + surges.get(e.module, 0)
        else:
            m = base
        out.append(m)
    return out


def predict(
    tree: ModuleTree, choices: Mapping[str, Choice], world_size: int | None = None
) -> Prediction:
    """Predicted peak and recompute of checkpointing the modules in ``choices`` (fqn → :data:`Choice`)."""
    outcomes = []
    for fqn, choice in sorted(choices.items(), key=lambda kv: tree.index_of(kv[0])):
        outcomes.append(module_outcome(tree.node(fqn).stats, choice))
    discards = {o.fqn: o.discard_bytes for o in outcomes}
    peaks = event_peaks(tree, discards, world_size, {o.fqn: o.surge_bytes for o in outcomes})
    base = event_peaks(tree, {}, world_size)
    i = max(range(len(peaks)), key=peaks.__getitem__) if peaks else 0
    return Prediction(
        peak_bytes=peaks[i] if peaks else 0,
        baseline_peak_bytes=max(base) if base else 0,
        recompute_ms=sum(o.recompute_ms for o in outcomes),
        recompute_flops=sum(o.recompute_flops for o in outcomes),
        peak_event=i,
        modules=tuple(outcomes),
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
