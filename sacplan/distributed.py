"""Per-rank statistics for FSDP2 / DDP from stats collected on one simulated (unsharded) rank.

:func:`shard_stats` turns the :class:`~sacplan.stats.ModelStats` of an ordinary single-process step into
the stats of *one rank* of an FSDP2 (``torch.distributed.fsdp.fully_shard``) or DDP job of ``world_size``
ranks. No process group is needed, so a laptop can plan for 512 GPUs::

    stats = collect("llama-70b", device="h100", dtype="bf16")
    per_rank = shard_stats(stats, 512, model=meta_model)          # fsdp_units="each block"
    plan = solve(ModuleTree(per_rank), "80GiB")                   # plans per rank

Memory model (FSDP2, the rank holding the largest shard, i.e. rank 0)
----------------------------------------------------------------------
For every timeline event ``e`` of the collected step::

    peak'_e = peak_e - state_e + sharded_state_e + allgather_e + reduce_scatter_e

* ``state_e`` (params + grads + optimizer state live at the event) is replaced by the rank's shard:
  each unit's parameters and optimizer state are ``ceil(dim0 / N)`` rows of every parameter (FSDP2 pads
  dim 0; with ``model`` given the exact shapes are used, otherwise ``ceil(bytes / N)`` per unit, an
  approximation that ignores padding); gradients of units whose backward finished are sharded, gradients
  still being accumulated (the running unit, the root) are full size.
* ``allgather_e``: unsharded parameters (``param_dtype``) of the units that are unsharded at ``e``: in
  forward the running units (the root from its forward to the end of its backward; with
  ``reshard_after_forward=False`` every unit whose forward ran until its backward ends); in backward the
  running units; plus the flat all-gather output buffer FSDP2 keeps alive (forward: the last all-gathered
  unit's, until the next unit's all-gather completes or the root's forward ends; backward: the prefetched
  next unit's).
* ``reduce_scatter_e``: the flat reduce-scatter input (``reduce_dtype``, padded, ``N ×`` shard) of the last
  unit whose backward finished, which FSDP2 keeps until the next reduce-scatter.
* After the backward (optimizer step) the non-state bytes are optimizer temporaries and scale with the shard.

DDP: every rank holds a full replica; with the default ``gradient_as_bucket_view=False`` the gradient
buckets (``bucket_cap_mb`` each, all together the size of all gradients) are allocated at construction and
live for the whole step, so every event grows by the gradient bytes.

The returned stats have ``world_size = N`` (so :func:`sacplan.solver.solve` does not scale state again) and
``meta["distributed"]`` describes the collective buffers for reports.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from sacplan.errors import ConfigError
from sacplan.fingerprint import canonical_names, model_fingerprint
from sacplan.blocks import repeated_blocks
from sacplan.stats import MemoryEvent, ModelStats, ModuleStats, Phase

__all__ = ["shard_stats", "check_units", "each_block_units", "UnitShard"]

UnitSpec = str | Sequence[str] | Callable[[str, ModuleStats], bool] | None

_DTYPE_BYTES = {
    "torch.float32": 4, "torch.float": 4, "torch.bfloat16": 2, "torch.float16": 2, "torch.half": 2,
    "torch.float64": 8, "torch.double": 8, "torch.float8_e4m3fn": 1, "torch.float8_e5m2": 1,
}


def _elt(dtype: Any) -> int:
    if dtype is None:
        return 0
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    key = str(dtype) if str(dtype).startswith("torch.") else "torch." + str(dtype)
    if key not in _DTYPE_BYTES:
        raise ConfigError(f"unknown dtype {dtype!r}")
    return _DTYPE_BYTES[key]


@dataclass(frozen=True)
class UnitShard:
    """One FSDP unit's bytes per rank.

    Attributes:
        fqn: the unit (root ``""``).
        param_bytes, grad_bytes, optimizer_bytes: unsharded (as collected) bytes the unit manages.
        sharded_param_bytes, sharded_grad_bytes, sharded_optimizer_bytes: one rank's shard (rank 0, padded).
        unsharded_bytes: all-gathered parameters in ``param_dtype`` (what compute uses).
        allgather_buffer_bytes: the flat all-gather output (``N ×`` padded shard, ``param_dtype``).
        reduce_scatter_bytes: the flat reduce-scatter input (``N ×`` padded shard, ``reduce_dtype``).
    """

    fqn: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    sharded_param_bytes: int
    sharded_grad_bytes: int
    sharded_optimizer_bytes: int
    unsharded_bytes: int
    allgather_buffer_bytes: int
    reduce_scatter_bytes: int


# ---------------------------------------------------------------------------------------------- units
def _inside(fqn: str, unit: str) -> bool:
    """``fqn`` is ``unit`` or lies in its subtree."""
    return unit == "" or fqn == unit or fqn.startswith(unit + ".")


def each_block_units(stats: ModelStats) -> list[str]:
    """The repeated blocks (:func:`sacplan.blocks.repeated_blocks`) plus the root ``""``."""
    return [""] + list(repeated_blocks(stats))


def _resolve_units(stats: ModelStats, fsdp_units: UnitSpec) -> list[str]:
    names = [m.fqn for m in stats.modules]
    if fsdp_units is None or (isinstance(fsdp_units, str) and fsdp_units == "each block"):
        units = each_block_units(stats)
    elif isinstance(fsdp_units, str):
        raise ConfigError(f"fsdp_units must be 'each block', a list of module names or a predicate, not {fsdp_units!r}")
    elif callable(fsdp_units):
        units = [m.fqn for m in stats.modules if fsdp_units(m.fqn, m)]
    else:
        try:
            units = list(fsdp_units)
        except TypeError:
            units = None
        if units is None or any(not isinstance(u, str) for u in units):
            raise ConfigError(
                f"fsdp_units must be 'each block', a list of module names (str) or a predicate, not {fsdp_units!r}"
            )
        known = set(names)
        for u in units:
            if u not in known:
                close = difflib.get_close_matches(u, names, n=3)
                raise ConfigError(
                    f"FSDP unit {u!r} is not a module of this model" + (f"; did you mean {close}?" if close else "")
                )
    if "" not in units:
        units = [""] + units  # fully_shard(root) always comes last and owns the rest
    order = {f: i for i, f in enumerate(names)}
    return sorted(set(units), key=order.__getitem__)


def check_units(tree: Any, ac_units: Iterable[str] | None, fsdp_units: Iterable[str] | None) -> None:
    """Raise :class:`ConfigError` if an FSDP unit lies strictly inside a checkpoint unit (or a name is unknown).

    Checkpointing a module that contains an FSDP unit would re-run that unit's all-gather hooks inside the
    recomputation; checkpoint the FSDP unit itself or modules inside it instead.
    """
    ac = list(ac_units or ())
    fs = list(fsdp_units or ())
    for f in ac + fs:
        tree.node(f)  # ConfigError with close matches
    for a in ac:
        for f in fs:
            if f != a and _inside(f, a) and not (a == "" and f == ""):
                raise ConfigError(
                    f"FSDP unit {f or '<root>'!r} is nested inside checkpoint unit {a or '<root>'!r}: checkpoint "
                    f"{f or '<root>'!r} itself or modules inside it, or drop {a or '<root>'!r} from the checkpoint units"
                )


def _check_model(stats: ModelStats, model: nn.Module) -> None:
    """Raise :class:`ConfigError` unless ``model`` is the model ``stats`` were collected from (fingerprint)."""
    if stats.fingerprint and model_fingerprint(model) != stats.fingerprint:  # looks through FSDP2 / DDP / compile
        theirs = set(canonical_names(model).values())
        ours = {m.fqn for m in stats.modules}
        containers = {n for n in theirs if any(o.startswith(n + ".") for o in ours) and n not in ours}
        diff = sorted((ours ^ theirs) - containers - {""})[:3]
        raise ConfigError(
            "model is not the model these stats were collected from (module names or parameter shapes differ"
            + (f", e.g. {diff}" if diff else "")
            + "): pass the same architecture (a meta-device copy is fine) or model=None"
        )


def _unit_params(model: nn.Module, units: list[str]) -> dict[str, list[torch.Size | tuple[int, ...]]]:
    """Parameter shapes (+dtype size) managed by each unit: those in its subtree but in no nested unit."""
    mods = dict(model.named_modules())
    for u in units:
        if u not in mods:
            close = difflib.get_close_matches(u, list(mods), n=3)
            raise ConfigError(f"FSDP unit {u!r} is not a module of the model" + (f"; did you mean {close}?" if close else ""))
    owner: dict[int, str] = {}
    # deepest units first claim their parameters
    for u in sorted(units, key=lambda f: (f.count(".") + (1 if f else 0)), reverse=True):
        for p in mods[u].parameters():
            owner.setdefault(id(p), u)
    out: dict[str, list[Any]] = {u: [] for u in units}
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        out[owner.get(id(p), "")].append((tuple(p.shape), p.element_size(), p.requires_grad))
    return out


def _unit_table(
    stats: ModelStats,
    units: list[str],
    world_size: int,
    model: nn.Module | None,
    param_dtype: Any,
    reduce_dtype: Any,
) -> tuple[dict[str, UnitShard], bool]:
    N = world_size
    spec = stats.device
    by = {m.fqn: m for m in stats.modules}
    # bytes owned by each unit = its subtree minus nested units' subtrees (stats are subtree totals)
    own: dict[str, list[int]] = {}
    for u in units:
        m = by[u]
        own[u] = [m.param_bytes, m.grad_bytes, m.optimizer_bytes]
    for u in units:
        parent = max((v for v in units if v != u and _inside(u, v)), key=len, default=None)
        if parent is not None:
            for i in range(3):
                own[parent][i] -= own[u][i]
    stat_elt = _elt(stats.dtype)
    p_elt = _elt(param_dtype) or stat_elt
    shapes = _unit_params(model, units) if model is not None else None
    out: dict[str, UnitShard] = {}
    for u in units:
        pb, gb, ob = (max(0, x) for x in own[u])
        if shapes is not None:
            plist = shapes[u]
            full = sum(math.prod(s) * e for s, e, _ in plist)
            shard = sum((math.ceil(s[0] / N) * math.prod(s[1:]) if s else 1) * e for s, e, _ in plist)
            numel_full = sum(math.prod(s) for s, _, _ in plist)
            numel_pad = sum((math.ceil(s[0] / N) * N * math.prod(s[1:]) if s else N) for s, _, _ in plist)
            ratio = shard / full if full else 0.0
        else:
            numel_full = pb // max(1, stat_elt)
            numel_pad = math.ceil(numel_full / N) * N
            ratio = math.ceil(pb / N) / pb if pb else 0.0
        r_elt = _elt(reduce_dtype) or p_elt
        out[u] = UnitShard(
            fqn=u,
            param_bytes=pb,
            grad_bytes=gb,
            optimizer_bytes=ob,
            sharded_param_bytes=spec.round_alloc(int(math.ceil(pb * ratio))) if pb else 0,
            sharded_grad_bytes=spec.round_alloc(int(math.ceil(gb * ratio))) if gb else 0,
            sharded_optimizer_bytes=int(math.ceil(ob * ratio)),
            unsharded_bytes=numel_full * p_elt,
            allgather_buffer_bytes=spec.round_alloc(numel_pad * p_elt) if numel_pad else 0,
            reduce_scatter_bytes=spec.round_alloc(numel_pad * r_elt) if gb else 0,
        )
    return out, shapes is None


# --------------------------------------------------------------------------------------------- events
def _fsdp_events(
    stats: ModelStats, units: list[str], tab: dict[str, UnitShard], reshard_after_forward: bool
) -> tuple[list[MemoryEvent], list[tuple[int, int, int]]]:
    """Per-rank events and per event (sharded state, all-gather bytes, reduce-scatter bytes)."""
    non_root = [u for u in units if u != ""]
    P = stats.param_bytes
    O = stats.optimizer_bytes
    Ps = sum(t.sharded_param_bytes for t in tab.values())
    Os = sum(t.sharded_optimizer_bytes for t in tab.values())
    ratio_all = (Ps / P) if P else 0.0

    def innermost(fqn: str, cands: Iterable[str]) -> list[str]:
        return [u for u in cands if _inside(fqn, u)]

    bw_units_order = [f for f in stats.bw_pre_order if f in tab and f != ""]
    n_bw = len(stats.bw_pre_order)
    new_events: list[MemoryEvent] = []
    parts: list[tuple[int, int, int]] = []
    for e in stats.events:
        grad_live = max(0, e.state_bytes - P - O)
        ag = rs = 0
        running = innermost(e.module, non_root)
        if e.phase == Phase.FW or (e.phase == Phase.OTHER and e.bw_started == 0):
            done = set(stats.fw_post_order[: e.fw_done]) & set(non_root)
            open_units = set(running)
            if not reshard_after_forward:
                open_units |= done
            ag = tab[""].unsharded_bytes + sum(tab[u].unsharded_bytes for u in open_units)
            # the last all-gathered unit's flat output lives until the next unit's all-gather completes
            if running:
                last = max(running, key=len)
            else:
                fin = [x for x in stats.fw_post_order[: e.fw_done] if x in tab and x != ""]
                last = fin[-1] if fin else ""
            if e.phase == Phase.FW:  # the root's post-forward frees it before the loss
                ag += tab[last].allgather_buffer_bytes
            sharded = Ps + Os
        elif e.phase in (Phase.BW, Phase.RC) or (e.phase == Phase.OTHER and e.bw_started < n_bw):
            started = stats.bw_pre_order[: e.bw_started]
            started_units = [u for u in bw_units_order if u in set(started)]
            run_set = set(running)
            done = [u for u in started_units if u not in run_set]
            not_started = [u for u in bw_units_order if u not in set(started_units)]
            open_units = set(running)
            if not reshard_after_forward:
                open_units |= set(not_started)
            ag = tab[""].unsharded_bytes + sum(tab[u].unsharded_bytes for u in open_units)
            if not_started and reshard_after_forward:
                ag += tab[not_started[0]].allgather_buffer_bytes  # prefetched next unit
            if done:
                rs = tab[done[-1]].reduce_scatter_bytes
            g_done = sum(tab[u].grad_bytes for u in done)
            gs_done = sum(tab[u].sharded_grad_bytes for u in done)
            sharded = Ps + Os + gs_done + max(0, grad_live - g_done)
        else:  # after the backward: optimizer step, zero_grad
            sharded = Ps + Os + int(math.ceil(grad_live * ratio_all))
            rest = e.peak_bytes - e.state_bytes
            new_peak = sharded + int(math.ceil(rest * ratio_all))
            new_events.append(dataclasses.replace(e, peak_bytes=new_peak, state_bytes=sharded))
            parts.append((sharded, 0, 0))
            continue
        new_peak = e.peak_bytes - e.state_bytes + sharded + ag + rs
        new_events.append(dataclasses.replace(e, peak_bytes=new_peak, state_bytes=sharded))
        parts.append((sharded, ag, rs))
    return new_events, parts


def shard_stats(
    stats: ModelStats,
    world_size: int,
    *,
    fsdp_units: UnitSpec = "each block",
    mode: str = "fsdp",
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | str | None = None,
    reduce_dtype: torch.dtype | str | None = None,
    bucket_cap_mb: float = 25,
    model: nn.Module | None = None,
) -> ModelStats:
    """Stats of one rank of an FSDP2 / DDP job of ``world_size`` ranks (see the module docstring).

    Args:
        stats: collected on one unsharded rank (``stats.world_size == 1``), in the compute dtype (with a
            ``param_dtype`` policy, collect with ``dtype=param_dtype``: activations are taken as collected).
        world_size: ranks ``N`` (>= 1).
        fsdp_units: ``"each block"`` (repeated blocks + root), module names, or a predicate
            ``(fqn, ModuleStats) -> bool``; the root is always a unit. FSDP only.
        mode: ``"fsdp"`` (FSDP2 ``fully_shard``) or ``"ddp"``.
        reshard_after_forward: FSDP2's flag for the non-root units (the root never reshards after forward).
        param_dtype, reduce_dtype: FSDP2 ``MixedPrecisionPolicy`` dtypes (None: the stats' dtype).
        bucket_cap_mb: DDP bucket size (the buckets together hold every gradient either way).
        model: the model (``meta``/fake is fine) for exact per-parameter shapes (dim-0 padding); without
            it each unit's shard is ``ceil(bytes / N)`` (padding ignored, noted in ``meta``).

    Raises:
        ConfigError: ``world_size < 1``, unknown mode or unit, ``fsdp_units`` of a wrong type, stats already
            per rank, ``model`` not the model the stats were collected from.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    if mode not in ("fsdp", "ddp"):
        raise ConfigError(f"mode must be 'fsdp' or 'ddp', got {mode!r}")
    if stats.world_size != 1:
        raise ConfigError(f"shard_stats needs stats of one unsharded rank; these are already per rank of {stats.world_size}")
    if bucket_cap_mb <= 0:
        raise ConfigError(f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
    G = stats.grad_bytes
    if mode == "ddp":
        bucket_bytes = stats.device.round_alloc(G) if G else 0
        n_buckets = max(1, math.ceil(G / (bucket_cap_mb * 2**20))) if G else 0
        events = [dataclasses.replace(e, peak_bytes=e.peak_bytes + bucket_bytes) for e in stats.events]
        info = {
            "mode": "ddp",
            "world_size": world_size,
            "bucket_cap_mb": bucket_cap_mb,
            "buckets": n_buckets,
            "gradient_bucket_bytes": bucket_bytes,
            "collective_peak_bytes": bucket_bytes,
            "note": "gradient_as_bucket_view=False: buckets hold a second copy of every gradient for the whole step",
        }
        return _finish(stats, world_size, events, info, stats.param_bytes, stats.grad_bytes, stats.optimizer_bytes)

    units = _resolve_units(stats, fsdp_units)
    if model is not None:
        _check_model(stats, model)
    tab, approx = _unit_table(stats, units, world_size, model, param_dtype, reduce_dtype)
    events, parts = _fsdp_events(stats, units, tab, reshard_after_forward)
    i = max(range(len(events)), key=lambda k: events[k].peak_bytes) if events else 0
    info = {
        "mode": "fsdp",
        "world_size": world_size,
        "units": units,
        "reshard_after_forward": reshard_after_forward,
        "param_dtype": str(param_dtype) if param_dtype is not None else stats.dtype,
        "reduce_dtype": str(reduce_dtype) if reduce_dtype is not None else (str(param_dtype) if param_dtype is not None else stats.dtype),
        "shapes": "approximate (ceil(bytes/N) per unit, no dim-0 padding)" if approx else "exact (per-parameter dim-0 padding)",
        "sharded_state_bytes": parts[i][0] if parts else 0,
        "allgather_bytes": parts[i][1] if parts else 0,
        "reduce_scatter_bytes": parts[i][2] if parts else 0,
        "allgather_peak_bytes": max((p[1] for p in parts), default=0),
        "reduce_scatter_peak_bytes": max((p[2] for p in parts), default=0),
        "collective_peak_bytes": max((p[1] + p[2] for p in parts), default=0),
        "per_unit": {u: dataclasses.asdict(t) for u, t in tab.items()},
    }
    Ps = sum(t.sharded_param_bytes for t in tab.values())
    Gs = sum(t.sharded_grad_bytes for t in tab.values())
    Os = sum(t.sharded_optimizer_bytes for t in tab.values())
    return _finish(stats, world_size, events, info, Ps, Gs, Os)


def _finish(
    stats: ModelStats, world_size: int, events: list[MemoryEvent], info: Mapping[str, Any], Ps: int, Gs: int, Os: int
) -> ModelStats:
    i = max(range(len(events)), key=lambda k: events[k].peak_bytes) if events else 0
    peak = events[i].peak_bytes if events else stats.peak_bytes
    snap = stats.peak_snapshot
    new_snap = dataclasses.replace(
        snap,
        param=Ps if snap.param else 0,
        grad=min(Gs, snap.grad) if info["mode"] == "fsdp" else snap.grad,
        optimizer=Os if snap.optimizer else 0,
    )
    new_snap = dataclasses.replace(new_snap, other=max(0, peak - (new_snap.total - new_snap.other)))
    meta = dict(stats.meta)
    meta["distributed"] = dict(info)
    return dataclasses.replace(
        stats,
        world_size=world_size,
        events=tuple(events),
        peak_bytes=peak,
        peak_phase=events[i].phase if events else stats.peak_phase,
        peak_module=events[i].module if events else stats.peak_module,
        peak_snapshot=new_snap,
        param_bytes=Ps,
        grad_bytes=Gs,
        optimizer_bytes=Os,
        meta=meta,
    )
