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

Prefetch: a unit's pre-backward (the root's included) prefetches the next unit, so before the first one
(the loss backward) no prefetched buffer exists.

Mixed precision (``mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``): collect in the
compute dtype (parameters in ``param_dtype``; buffers such as a rotary table in their own dtype, as FSDP2
leaves them), pass the model in its own (master) dtype. Activations and the unsharded gradients of the
running units are as collected; sharded parameters, their gradients and the optimizer state are rescaled to
the master dtype (``master_dtype``, default the model's); the all-gathered parameters and buffers are in
``param_dtype``, the reduce-scatter input in ``reduce_dtype``. Validated on 2 gloo ranks within 1% per rank
(``tests/distributed/test_mixed_precision.py``).

Groups: ``fsdp_units=[..., ("norm", "output")]`` is ``fully_shard([model.norm, model.output])`` (see
:mod:`sacplan.fsdp_units` for when a group all-gathers and reshards).

DDP: every rank holds a full replica; with the default ``gradient_as_bucket_view=False`` the gradient
buckets (``bucket_cap_mb`` each, all together the size of all gradients) are allocated at construction and
live for the whole step, so every event grows by the gradient bytes.

The returned stats have ``world_size = N`` (so :func:`sacplan.solver.solve` does not scale state again) and
``meta["distributed"]`` describes the collective buffers for reports.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from sacplan.collector.arguments import parse_dtype
from sacplan.errors import ConfigError
from sacplan.fsdp_units import (
    Unit, UnitShard, UnitSpec, check_model, dtype_bytes, each_block_units, resolve_units, unit_table,
)
from sacplan.fqns import inside
from sacplan.stats import MemoryEvent, ModelStats, Phase

__all__ = ["shard_stats", "check_units", "each_block_units", "unit_modules", "UnitShard", "Unit"]


def unit_modules(per_rank: ModelStats) -> list[str]:
    """The fqns ``fully_shard`` was called on (every member of every non-root unit) in per-rank stats, for
    ``solve(..., fsdp_units=...)`` and :func:`check_units`; ``[]`` for DDP or unsharded stats."""
    units = per_rank.meta.get("distributed", {}).get("units") or []
    out: list[str] = []
    for u in units:
        out += [u] if isinstance(u, str) else list(u)
    return [u for u in out if u]


def check_units(tree: Any, ac_units: Iterable[str] | None, fsdp_units: Iterable[str] | None) -> None:
    """Raise :class:`ConfigError` if an FSDP unit lies strictly inside a checkpoint unit (or a name is unknown).

    Checkpointing a module that contains an FSDP unit would re-run that unit's all-gather hooks inside the
    recomputation; checkpoint the FSDP unit itself or modules inside it instead. A group's members count as
    FSDP units each (pass :func:`unit_modules`).
    """
    ac = list(ac_units or ())
    fs = list(fsdp_units or ())
    for f in ac + fs:
        tree.node(f)  # ConfigError with close matches
    for a in ac:
        for f in fs:
            if f != a and inside(f, a) and not (a == "" and f == ""):
                raise ConfigError(
                    f"FSDP unit {f or '<root>'!r} is nested inside checkpoint unit {a or '<root>'!r}: checkpoint "
                    f"{f or '<root>'!r} itself or modules inside it, or drop {a or '<root>'!r} from the checkpoint units"
                )


# --------------------------------------------------------------------------------------------- events
def _forward_open(stats: ModelStats, e: MemoryEvent, units: list[Unit]) -> tuple[set[Unit], Unit | None]:
    """Non-root units unsharded at forward event ``e``, and the unit all-gathered last (its flat buffer lives)."""
    done_mods = set(stats.fw_post_order[: e.fw_done])
    open_units: set[Unit] = set()
    running = [u for u in units if u.contains(e.module)]
    for u in units:
        n_done = sum(m in done_mods for m in u.members)
        if u in running or 0 < n_done < len(u.members) or (n_done and not u.reshard_after_forward):
            open_units.add(u)
    if running:  # nested units all-gather after their parents
        return open_units, max(running, key=lambda u: max(len(m) for m in u.members))
    owner = {m: u for u in units for m in u.members}
    fin = [owner[x] for x in stats.fw_post_order[: e.fw_done] if x in owner]
    return open_units, (fin[-1] if fin else None)


def _backward_state(
    stats: ModelStats, e: MemoryEvent, units: list[Unit], first: Mapping[str, int]
) -> tuple[set[Unit], list[Unit], list[Unit]]:
    """At backward event ``e``: units unsharded for their backward, units done (by finish), units not begun (by
    start). ``first``: each module's first position in ``bw_pre_order``."""
    started = stats.bw_pre_order[: e.bw_started]
    pos = {f: i for i, f in enumerate(started)}  # last start among the begun calls
    open_units: set[Unit] = set()
    done: list[Unit] = []
    not_started: list[Unit] = []
    for u in units:
        begun = [m for m in u.members if m in pos]
        finished = [m for m in begun if not inside(e.module, m)]
        if not begun:
            not_started.append(u)
        elif len(finished) == len(u.members):
            done.append(u)
        else:
            open_units.add(u)
    done.sort(key=lambda u: max(pos[m] for m in u.members))
    not_started.sort(key=lambda u: min((first.get(m, len(first)) for m in u.members)))
    return open_units, done, not_started


def _fsdp_events(
    stats: ModelStats, units: list[Unit], tab: dict[Unit, UnitShard]
) -> tuple[list[MemoryEvent], list[tuple[int, int, int]]]:
    """Per-rank events and per event (sharded state, all-gather bytes, reduce-scatter bytes)."""
    root = next(u for u in units if u.is_root)
    non_root = [u for u in units if not u.is_root]
    P = stats.param_bytes
    O = stats.optimizer_bytes
    Ps = sum(t.sharded_param_bytes for t in tab.values())
    Os = sum(t.sharded_optimizer_bytes for t in tab.values())
    ratio_all = (Ps / P) if P else 0.0  # collected state bytes -> one rank's master-dtype shard
    n_bw = len(stats.bw_pre_order)
    first: dict[str, int] = {}
    for i, f in enumerate(stats.bw_pre_order):
        first.setdefault(f, i)
    members = {m for u in units for m in u.members}
    new_events: list[MemoryEvent] = []
    parts: list[tuple[int, int, int]] = []
    for e in stats.events:
        grad_live = max(0, e.state_bytes - P - O)
        ag = rs = 0
        if e.phase == Phase.FW or (e.phase == Phase.OTHER and e.bw_started == 0):
            open_units, last = _forward_open(stats, e, non_root)
            ag = tab[root].unsharded_bytes + sum(tab[u].unsharded_bytes for u in open_units)
            if e.phase == Phase.FW and "" not in stats.fw_post_order[: e.fw_done]:  # the root's post-forward frees it
                ag += tab[last or root].allgather_buffer_bytes
            sharded = Ps + Os
        elif e.phase in (Phase.BW, Phase.RC) or (e.phase == Phase.OTHER and e.bw_started < n_bw):
            open_units, done, not_started = _backward_state(stats, e, non_root, first)
            open_units |= {u for u in not_started if not u.reshard_after_forward}
            ag = tab[root].unsharded_bytes + sum(tab[u].unsharded_bytes for u in open_units)
            nxt = [u for u in not_started if u.reshard_after_forward]
            # a unit's pre-backward (the root's included) prefetches the next unit: none before the first one
            if nxt and any(f in members for f in stats.bw_pre_order[: e.bw_started]):
                ag += tab[nxt[0]].allgather_buffer_bytes
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


def _precision(
    stats: ModelStats, mp_policy: Any, param_dtype: Any, reduce_dtype: Any, master_dtype: Any, model: nn.Module | None
) -> tuple[Any, Any, Any]:
    """(param, reduce, master) dtypes of the job; refuses a policy the stats were not collected for."""
    if mp_policy is not None:
        if param_dtype is not None or reduce_dtype is not None:
            raise ConfigError("pass either mp_policy or param_dtype/reduce_dtype, not both")
        if not hasattr(mp_policy, "param_dtype") or not hasattr(mp_policy, "reduce_dtype"):
            raise ConfigError(f"mp_policy must be FSDP2's MixedPrecisionPolicy (param_dtype, reduce_dtype), got {mp_policy!r}")
        param_dtype, reduce_dtype = mp_policy.param_dtype, mp_policy.reduce_dtype
    stat = stats.dtype
    if param_dtype is not None and dtype_bytes(param_dtype) != dtype_bytes(stat):
        raise ConfigError(
            f"the stats were collected in {stat} but FSDP2 computes in param_dtype={param_dtype}: activations and "
            f"unsharded gradients are in the compute dtype, so collect with dtype={str(param_dtype).replace('torch.', '')!r}"
            " (and pass the model in its own dtype as model=, for the master shards)"
        )
    if master_dtype is None:
        if param_dtype is None:
            master_dtype = stat  # no mixed precision: shards in the dtype the step ran in
        elif model is not None:
            master_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        else:
            master_dtype = torch.float32  # FSDP2 mixed precision keeps fp32 master shards
    dtype_bytes(master_dtype)  # ConfigError on an unknown name
    return param_dtype, reduce_dtype if reduce_dtype is not None else param_dtype, master_dtype


def shard_stats(
    stats: ModelStats,
    world_size: int,
    *,
    fsdp_units: UnitSpec = "each block",
    mode: str = "fsdp",
    reshard_after_forward: bool | Mapping[Any, bool] = True,
    mp_policy: Any = None,
    param_dtype: torch.dtype | str | None = None,
    reduce_dtype: torch.dtype | str | None = None,
    master_dtype: torch.dtype | str | None = None,
    bucket_cap_mb: float = 25,
    model: nn.Module | None = None,
) -> ModelStats:
    """Stats of one rank of an FSDP2 / DDP job of ``world_size`` ranks (see the module docstring).

    Args:
        stats: collected on one unsharded rank (``stats.world_size == 1``) in the compute dtype: with a
            mixed-precision policy, ``collect(..., dtype=param_dtype)`` (activations and unsharded gradients
            are taken as collected; sharded state is rescaled to the master dtype).
        world_size: ranks ``N`` (>= 1).
        fsdp_units: ``"each block"`` (repeated blocks + root), a list whose entries are module names or groups
            of names (``["layers.0", ("norm", "output")]`` for ``fully_shard([model.norm, model.output])``), or
            a predicate ``(fqn, ModuleStats) -> bool``; the root is always a unit. FSDP only.
        mode: ``"fsdp"`` (FSDP2 ``fully_shard``) or ``"ddp"``.
        reshard_after_forward: FSDP2's flag for every non-root unit, or a mapping ``{unit: flag}`` (a unit is a
            fqn or a tuple of fqns; unnamed units keep ``True``). The root never reshards after forward.
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` (its ``param_dtype`` and ``reduce_dtype``).
        param_dtype, reduce_dtype: the same dtypes given directly (instead of ``mp_policy``); None: no cast.
        master_dtype: dtype of the sharded parameters, their gradients and the optimizer state; default the
            ``model``'s parameter dtype under a policy (float32 without ``model``), else the stats' dtype.
        bucket_cap_mb: DDP bucket size (the buckets together hold every gradient either way).
        model: the model (``meta``/fake is fine, in its own dtype) for exact per-parameter shapes (dim-0
            padding); without it each unit's shard is ``ceil(bytes / N)`` (padding ignored, noted in ``meta``).

    Raises:
        ConfigError: ``world_size < 1``, unknown mode or unit, ``fsdp_units`` of a wrong type, stats already
            per rank, ``model`` not the model the stats were collected from, stats not collected in
            ``param_dtype``, both ``mp_policy`` and dtypes given.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    if mode not in ("fsdp", "ddp"):
        raise ConfigError(f"mode must be 'fsdp' or 'ddp', got {mode!r}")
    if stats.world_size != 1:
        raise ConfigError(f"shard_stats needs stats of one unsharded rank; these are already per rank of {stats.world_size}")
    if bucket_cap_mb <= 0:
        raise ConfigError(f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
    if mode == "ddp":
        return _ddp(stats, world_size, bucket_cap_mb)
    units = resolve_units(stats, fsdp_units, reshard_after_forward)
    if model is not None:
        check_model(stats, model)
    p_dt, r_dt, m_dt = _precision(stats, mp_policy, param_dtype, reduce_dtype, master_dtype, model)
    tab, approx = unit_table(stats, units, world_size, model, p_dt, r_dt, m_dt)
    events, parts = _fsdp_events(stats, units, tab)
    i = max(range(len(events)), key=lambda k: events[k].peak_bytes) if events else 0
    info = {
        "mode": "fsdp",
        "world_size": world_size,
        "units": [u.to_json() for u in units],
        "reshard_after_forward": {u.key: u.reshard_after_forward for u in units if not u.is_root},
        "param_dtype": _name(p_dt, stats.dtype),
        "reduce_dtype": _name(r_dt, stats.dtype),
        "master_dtype": _name(m_dt, stats.dtype),
        "shapes": "approximate (ceil(bytes/N) per unit, no dim-0 padding)" if approx else "exact (per-parameter dim-0 padding)",
        "sharded_state_bytes": parts[i][0] if parts else 0,
        "allgather_bytes": parts[i][1] if parts else 0,
        "reduce_scatter_bytes": parts[i][2] if parts else 0,
        "allgather_peak_bytes": max((p[1] for p in parts), default=0),
        "reduce_scatter_peak_bytes": max((p[2] for p in parts), default=0),
        "collective_peak_bytes": max((p[1] + p[2] for p in parts), default=0),
        "per_unit": {u.key: dataclasses.asdict(t) for u, t in tab.items()},
    }
    Ps = sum(t.sharded_param_bytes for t in tab.values())
    Gs = sum(t.sharded_grad_bytes for t in tab.values())
    Os = sum(t.sharded_optimizer_bytes for t in tab.values())
    return _finish(stats, world_size, events, info, Ps, Gs, Os)


def _name(dtype: Any, default: str) -> str:
    """``"torch.bfloat16"`` for ``"bf16"``, ``torch.bfloat16`` or ``"torch.bfloat16"``; ``default`` for None."""
    if dtype is None:
        return default
    return str(dtype) if str(dtype).startswith("torch.") else str(parse_dtype(dtype))


def _ddp(stats: ModelStats, world_size: int, bucket_cap_mb: float) -> ModelStats:
    G = stats.grad_bytes
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
