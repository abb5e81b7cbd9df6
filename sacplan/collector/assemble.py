"""Turn a recorded step (:class:`~sacplan.collector.tracker.StepRecorder`) into :class:`~sacplan.stats.ModelStats`.

Per module: its calls' snapshots (bytes per category), the first call's op list and trade-off curve, the
activation bytes each call can discard, gradient / transient bytes, times (ms) and FLOPs; per step: the
timeline's segments merged into :class:`~sacplan.stats.MemoryEvent` entries, the peak and the static bytes of
parameters, gradients and optimizer state, each rounded by the target's allocator.
"""

from __future__ import annotations

import torch
from torch import nn

from sacplan.collector.kernels import host_state_tensors
from sacplan.collector.mutations import StorageWrites
from sacplan.collector.records import GRAD, OPT, PARAM, CallRecord
from sacplan.collector.storage import tensor_bytes_of
from sacplan.collector.tracker import StepRecorder
from sacplan.devices import DeviceSpec
from sacplan.errors import UnsupportedModelError
from sacplan.fingerprint import input_shapes_of, model_fingerprint
from sacplan.stats import CATEGORIES, MemoryEvent, MemSnapshot, ModelStats, ModuleStats, OpStat, Phase, TradeOff
from sacplan.tradeoff import build_tradeoff


def _snap(cats: tuple[int, ...]) -> MemSnapshot:
    return MemSnapshot(**dict(zip(CATEGORIES, cats)))


def _op_stats(rec: CallRecord, recorder: StepRecorder, ties: list[tuple[int, ...]]) -> tuple[tuple[OpStat, ...], int]:
    """The :class:`OpStat` s of one call (``ties``: per op, see :meth:`StorageWrites.ties`) and its recompute stop."""
    ops = recorder.ops[rec.op_start : rec.op_end]
    packed = recorder.packed_at  # storage keys of the tensors autograd saved
    out_sids = set(rec.out_sids)
    peak = sum(rec.peak_fw)
    seen: dict[str, int] = {}
    result = []
    for k, o in enumerate(ops):
        name = str(o.func)
        occ = seen.get(name, 0)
        seen[name] = occ + 1
        parent = None
        if o.is_inplace:
            parent = o.inplace_parent - rec.op_start if o.inplace_parent is not None and o.inplace_parent >= rec.op_start else k
        is_out = any(s in out_sids for s in o.out_sids)
        saved = any(s in packed for s in o.out_sids)
        # Saving the op that makes the module's output holds nothing extra for the output storages if the output
        # is kept anyway; its other outputs (attention's log-sum-exp beside its output) are still held.
        if is_out and any(s in packed for s in rec.out_sids):
            cost = sum(b for s, b in zip(o.out_sids, o.out_new) if s not in out_sids)
        else:
            cost = o.new_bytes
        mine = [s for s, b in zip(o.out_sids, o.out_new) if s in out_sids and b > 0]  # output storages it makes
        outside = bool(mine) and all(s in packed and not recorder.packed_by(rec, s) for s in mine)
        result.append(
            OpStat(
                index=k, name=name, occurrence=occ, out_bytes=o.new_bytes, runtime_ms=o.ms, flops=o.flops,
                is_view=o.is_view, is_random=o.is_random, inplace_of=parent, saved_by_autograd=saved,
                is_output=is_out, save_cost_bytes=cost if not o.is_view else 0,
                below_peak_bytes=max(0, peak - o.live), tied_to=ties[k] if k < len(ties) else (),
                output_kept_outside=outside,
                cached_cast=any(s in recorder.weight_casts for s, b in zip(o.out_sids, o.out_new) if b > 0),
            )
        )
    stop = max(0, rec.last_pack - rec.op_start) if rec.last_pack >= 0 else 0
    return tuple(result), min(stop, len(result))


def _call_ties(recs: list[CallRecord], recorder: StepRecorder, writes: StorageWrites) -> list[list[tuple[int, ...]]]:
    """Per call of one module, the ties of its ops (:meth:`StorageWrites.ties`). Calls running the first call's op
    sequence share the union of their ties: one plan serves every call, so it must be safe for each (see
    :mod:`sacplan.collector.mutations`); a call running other ops keeps its own."""
    def funcs(r: CallRecord) -> list:
        return [o.func for o in recorder.ops[r.op_start : r.op_end]]

    names = funcs(recs[0])
    own = [writes.ties(r.op_start, r.op_end) for r in recs]
    same = [k == 0 or funcs(r) == names for k, r in enumerate(recs)]
    merged: list[list[int]] = [[] for _ in names]
    for ties in (t for t, s in zip(own, same) if s):
        for k, tied in enumerate(ties):
            merged[k].extend(t for t in tied if t not in merged[k])
    shared = [tuple(t) for t in merged]
    return [shared if s else t for t, s in zip(own, same)]


def _trade_off(
    recs: list[CallRecord], recorder: StepRecorder, writes: StorageWrites, max_lines: int
) -> tuple[tuple[OpStat, ...], int, TradeOff | None, list[int]]:
    """One module's first-call ops, recompute stop and trade-off (``None``: never a checkpoint region), and the
    activation bytes each call can discard."""
    ties = _call_ties(recs, recorder, writes)
    ops, stop = _op_stats(recs[0], recorder, ties[0])
    tradeoff = build_tradeoff(ops, recs[0].act_kept, stop, max_lines)
    if any(writes.overwrites_arguments(r.arg_keys, r.op_start, r.op_end) for r in recs):
        tradeoff = None  # never a checkpoint region (sacplan.collector.mutations)
    discardable = [tradeoff.max_discard_bytes if tradeoff is not None else 0]
    for r, r_ties in zip(recs[1:], ties[1:]):
        o2, s2 = _op_stats(r, recorder, r_ties)
        t2 = build_tradeoff(o2, r.act_kept, s2, max_lines) if tradeoff is not None else None
        discardable.append(t2.max_discard_bytes if t2 is not None else 0)
    return ops, stop, tradeoff, discardable


def _static_bytes(model: nn.Module, opt: torch.optim.Optimizer | None, spec: DeviceSpec) -> dict[str, tuple[int, int, int]]:
    opt_bytes: dict[int, int] = {}
    if opt is not None:
        # a CUDA target keeps non-capturable optimizers' step scalars on the host (sacplan.collector.kernels)
        host = {id(t) for t in host_state_tensors(opt)} if spec.attention == "flash" else set()
        for p, state in opt.state.items():
            opt_bytes[id(p)] = sum(
                tensor_bytes_of(v, spec)  # a DTensor: its local shard
                for v in state.values()
                if isinstance(v, torch.Tensor) and id(v) not in host
            )
    out = {}
    for name, mod in model.named_modules():
        pb = gb = ob = 0
        for p in mod.parameters():
            b = tensor_bytes_of(p, spec)
            pb += b
            if p.requires_grad:
                gb += b
            ob += opt_bytes.get(id(p), 0)
        bb = sum(tensor_bytes_of(b, spec) for b in mod.buffers())
        out[name] = (pb, gb, ob, bb)
    return out


def _merge_events(recorder: StepRecorder) -> tuple[MemoryEvent, ...]:
    """Segments → events; neighbouring segments with the same counters keep only their peak."""
    events: list[MemoryEvent] = []
    for s in recorder.segments:
        state = s.cats[PARAM] + s.cats[GRAD] + s.cats[OPT]
        # a forward after some backward began (pipeline schedules, gradient accumulation) keeps its real position:
        # the timeline counts such events as interleaved (sacplan.timeline)
        ev = MemoryEvent(s.phase, s.module, s.call, s.fw_done, s.bw_started, s.peak, state, s.extra,
                         bw_done=s.bw_done if s.phase != Phase.FW else 0)
        if events and s.phase != Phase.RC:
            last = events[-1]
            if (last.phase, last.fw_done, last.bw_started, last.bw_done) == (ev.phase, ev.fw_done, ev.bw_started, ev.bw_done):
                if ev.peak_bytes > last.peak_bytes:
                    events[-1] = ev
                continue
        events.append(ev)
    return tuple(events)


def build_stats(
    recorder: StepRecorder,
    model: nn.Module,
    opt: torch.optim.Optimizer | None,
    spec: DeviceSpec,
    model_name: str,
    dtype: torch.dtype | None,
    args: tuple,
    max_lines: int,
) -> ModelStats:
    """The :class:`ModelStats` of the step ``recorder`` recorded on ``model`` for ``spec`` (``meta`` left empty
    for the caller; ``world_size`` 1). ``max_lines``: cap on trade-off lines per module.

    Raises:
        UnsupportedModelError: the step did not call one root module (the model) exactly once.
    """
    by_fqn: dict[str, list[CallRecord]] = {}
    for rec in recorder.calls:
        by_fqn.setdefault(rec.fqn, []).append(rec)
    has_children = {rec.parent.fqn for rec in recorder.calls if rec.parent is not None}
    static = _static_bytes(model, opt, spec)
    writes = StorageWrites(recorder.ops)
    modules = []
    for fqn, recs in by_fqn.items():
        first = recs[0]
        ops, stop, tradeoff, discardable = _trade_off(recs, recorder, writes, max_lines)
        pb, gb, ob, bb = static.get(fqn, (0, 0, 0, 0))
        snaps = []
        for r in recs:
            names = {"pre_fw": r.pre_fw, "peak_fw": r.peak_fw, "post_fw": r.post_fw, "pre_bw": r.pre_bw, "peak_bw": r.peak_bw, "post_bw": r.post_bw}
            snaps.append({k: _snap(v) for k, v in names.items() if v})
        modules.append(
            ModuleStats(
                fqn=fqn,
                module_type=type(model.get_submodule(fqn)).__name__ if fqn else type(model).__name__,
                parent=first.parent.fqn if first.parent is not None else None,
                depth=first.depth,
                is_leaf=fqn not in has_children,
                calls=len(recs),
                param_bytes=pb,
                buffer_bytes=bb,
                grad_bytes=gb,
                optimizer_bytes=ob,
                input_bytes=first.input_bytes,
                output_bytes=first.output_bytes,
                act_bytes=tuple(discardable),
                act_grad_bytes=tuple(max(0, sum(r.peak_bw) - sum(r.pre_bw)) if r.pre_bw else 0 for r in recs),
                fw_transient_bytes=tuple(max(0, sum(r.peak_fw) - sum(r.post_fw)) for r in recs),
                fw_ms=tuple(r.fw_ms for r in recs),
                bw_ms=tuple(r.bw_ms for r in recs),
                fw_flops=tuple(r.fw_flops for r in recs),
                bw_flops=tuple(r.bw_flops for r in recs),
                snapshots=tuple(snaps),
                ops=ops,
                recompute_stop=stop,
                tradeoff=tradeoff,
                held_input_bytes=tuple(recorder.held_by_checkpoint(r) for r in recs),
                cache_held=tuple(r.cache_held for r in recs) if any(r.cache_held for r in recs) else (),
                input_external_bytes=first.input_external_bytes,
            )
        )
    roots = [m for m in modules if m.parent is None]
    if len(roots) != 1 or modules[0].fqn != roots[0].fqn:
        raise UnsupportedModelError(
            f"{model_name}: expected one root module call per step, found {[m.fqn or '<root>' for m in roots]}; "
            "call the model once per step (wrap several calls in one nn.Module)"
        )
    total_static = static.get("", (0, 0, 0, 0))
    peak_phase, peak_module = recorder.step_peak_where
    return ModelStats(
        device=spec,
        model_name=model_name,
        dtype=str(dtype or next((p.dtype for p in model.parameters()), torch.float32)),
        world_size=1,
        modules=tuple(modules),
        fw_pre_order=tuple(recorder.fw_pre_order),
        fw_post_order=tuple(recorder.fw_post_order),
        bw_pre_order=tuple(recorder.bw_pre_order),
        bw_post_order=tuple(recorder.bw_post_order),
        events=_merge_events(recorder),
        peak_bytes=recorder.step_peak,
        peak_phase=peak_phase,
        peak_module=peak_module,
        peak_snapshot=_snap(recorder.step_peak_cats),
        param_bytes=total_static[0],
        grad_bytes=total_static[1],
        optimizer_bytes=total_static[2],
        fw_ms=recorder.fw_ms,
        bw_ms=recorder.bw_ms,
        optimizer_ms=recorder.opt_ms,
        fw_flops=recorder.fw_flops,
        bw_flops=recorder.bw_flops,
        fingerprint=model_fingerprint(model),
        input_shapes=input_shapes_of(args),
        meta={},
    )
