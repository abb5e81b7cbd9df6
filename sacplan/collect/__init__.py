"""``collect()``: one fake training step of a model → :class:`~sacplan.stats.ModelStats` for a target GPU.

No real memory is allocated: the model and its inputs are fake tensors (``FakeTensorMode``) on the host
CPU; sizes follow the *target* allocator, runtimes the target's roofline (or real timing with
``runtime="benchmark"`` on a CUDA host), and attention saves what the target's fused kernel saves.
"""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

from sacplan.collect.attention import FusedAttentionMode
from sacplan.collect.calling import as_inputs, as_loss, call_model
from sacplan.collect.hf import training_without_cache, transformers_real_paths
from sacplan.collect.kernels import cuda_host_kernels, host_state_tensors
from sacplan.collect.runtime import RuntimeModel
from sacplan.collect.records import ACT, BUFFER, GRAD, INPUT, OPT, PARAM, CallRecord
from sacplan.collect.tracker import StepRecorder
from sacplan.devices import DeviceSpec, get_device
from sacplan.errors import CollectionError, ConfigError, UnsupportedModelError
from sacplan.fingerprint import input_shapes_of, model_fingerprint
from sacplan.stats import CATEGORIES, MemoryEvent, MemSnapshot, ModelStats, ModuleStats, OpStat, Phase
from sacplan.tradeoff import DEFAULT_MAX_LINES, build_tradeoff

__all__ = ["collect", "default_loss", "default_optimizer"]

ModelArg = nn.Module | Callable[[], nn.Module] | str
TrainStep = Callable[[nn.Module, tuple, "torch.optim.Optimizer | None"], Any]


def default_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with ``foreach=True`` (what CUDA uses by default): 2 fp32-sized states per parameter."""
    return torch.optim.AdamW(params, lr=1e-4, foreach=True)


def default_loss(output: Any, inputs: tuple) -> torch.Tensor:
    """Mean of every floating-point output tensor, in fp32 (a stand-in with a full-size gradient)."""
    flat, _ = tree_flatten(output)
    terms = [t.float().mean() for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not terms:
        raise UnsupportedModelError(
            "the model's output has no floating-point tensor to take a loss of: pass loss_fn=... or train_step=..."
        )
    return torch.stack(terms).sum() if len(terms) > 1 else terms[0]


def collect(
    model: ModelArg,
    inputs: Any = None,
    *,
    device: str | DeviceSpec = "h100",
    optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None | bool = None,
    loss_fn: Callable[[Any, tuple], torch.Tensor] | None = None,
    train_step: TrainStep | None = None,
    dtype: torch.dtype | str | None = None,
    batch: int | None = None,
    seq: int | None = None,
    runtime: str = "roofline",
    model_name: str | None = None,
    max_lines: int = DEFAULT_MAX_LINES,
    progress: Callable[[str], None] | None = None,
    world_size: int = 1,
    fsdp_units: Any = "each block",
    ddp: bool = False,
) -> ModelStats:
    """Run one training step of ``model`` on fake tensors and return its statistics for ``device``.

    Args:
        model: an ``nn.Module`` (a real one is copied as fakes; one on the ``meta`` device is materialised
            in fake mode), a zero-argument factory (called on the ``meta`` device first, so initialisers
            with data-dependent ops never run; falls back to building inside fake mode), or a built-in
            preset name such as ``"llama-7b"`` (see :mod:`sacplan.models`).
        inputs: the forward's positional arguments (a tuple, or one tensor), its keyword arguments (a dict,
            e.g. ``{"input_ids": ids, "labels": ids}``), or a zero-argument factory of either, called inside
            fake mode. Presets make their own from ``batch``/``seq`` when omitted.
        device: target device name (``"h100"``, ``"a100-40gb"``...) or a :class:`DeviceSpec`.
        optimizer: factory ``params -> Optimizer`` (default AdamW, foreach); ``False`` for no optimizer step.
        loss_fn: ``(output, inputs) -> scalar`` or ``(output) -> scalar`` (e.g. ``lambda out: out.loss``;
            decided by the signature, see :mod:`sacplan.collect.calling`); default :func:`default_loss` (presets bring their own).
        train_step: ``(model, inputs, optimizer) -> Any`` running forward, backward and optimizer step
            yourself; replaces the built-in loop (``loss_fn`` is then unused). It runs twice (the first
            creates optimizer state).
        dtype: cast parameters to this dtype (``torch.bfloat16`` or ``"bf16"``).
        batch, seq: example-input sizes for presets.
        runtime: ``"roofline"`` or ``"benchmark"`` (times ops on the CUDA device present).
        model_name: label for reports (defaults to the preset name or class name).
        max_lines: cap on trade-off lines per module before the curve is simplified (chords of its biggest bends).
        progress: called with short status strings (for CLIs on large models).
        world_size: ranks to plan for (simulated: no process group needed). Above 1 the returned stats are
            per rank, through :func:`sacplan.distributed.shard_stats`.
        fsdp_units: FSDP2 units when ``world_size > 1``: ``"each block"`` (repeated blocks + root), a list of
            fqns, or a predicate ``(fqn, ModuleStats) -> bool``.
        ddp: plan for DDP replicas (gradient buckets) instead of FSDP2.

    Returns:
        :class:`ModelStats` of the second step (optimizer state exists), sizes per the target allocator.

    Raises:
        UnknownDeviceError, ConfigError: bad arguments.
        CollectionError: the fake step failed; the message names the module that was running.
    """
    t_start = time.perf_counter()
    say = progress or (lambda s: None)
    spec = get_device(device)
    dtype = parse_dtype(dtype)
    rt = RuntimeModel(spec, runtime)
    preset = None
    if isinstance(model, str):
        from sacplan.models import get_model

        preset = get_model(model)
        model_name = model_name or preset.name
    if optimizer is True:
        optimizer = None
    if not (optimizer is None or optimizer is False or callable(optimizer)):
        raise ConfigError(
            f"optimizer must be a factory params -> torch.optim.Optimizer (e.g. lambda p: torch.optim.Adam(p)), None "
            f"for AdamW, or False for no optimizer step; got {optimizer!r:.60}"
        )
    if isinstance(max_lines, bool) or not isinstance(max_lines, int) or max_lines < 1:
        raise ConfigError(f"max_lines must be an integer >= 1 (trade-off lines per module), got {max_lines!r:.60}")
    opt_factory = None if optimizer is False else (optimizer or default_optimizer)

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    say(f"building {model_name or 'model'} on fake tensors")
    fmodel = _build_fake_model(model, preset, fake_mode, dtype)
    model_name = model_name or type(fmodel).__name__
    for mod in fmodel.modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.momentum is None:
            # A cumulative moving average (momentum=None) computes its factor 1/n with .item(), which fake
            # tensors cannot answer. Any fixed factor runs the same ops on the same bytes; the copy is ours.
            mod.momentum = 0.1
    trainable = [p for p in fmodel.parameters() if p.requires_grad]
    if not trainable and opt_factory is not None:
        raise ConfigError(
            f"{model_name} has no trainable parameters (all requires_grad=False), so there is nothing to optimize: "
            "pass optimizer=False (the backward then needs inputs that require grad), or unfreeze some parameters"
        )
    with fake_mode:
        args = _make_inputs(inputs, preset, fake_mode, batch, seq, dtype)
        if loss_fn is None and preset is not None:
            loss_fn = preset.loss_fn
        loss = as_loss(loss_fn) if loss_fn is not None else default_loss
        opt = opt_factory(trainable) if opt_factory else None

    recorder = StepRecorder(fmodel, spec, rt)
    hooks = _install_state_hooks(fmodel, opt, recorder, cuda_target=spec.attention == "flash")
    attention = FusedAttentionMode(lambda: setattr(recorder, "next_sdpa_random", True)) if spec.attention == "flash" else contextlib.nullcontext()
    host_kernels = cuda_host_kernels() if spec.attention == "flash" else contextlib.nullcontext()

    def builtin_step() -> None:
        out = call_model(fmodel, args)
        l = loss(out, args)
        del out
        recorder.close_segment(Phase.FW)
        l.backward()
        del l
        recorder.close_segment(Phase.BW)
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            fmodel.zero_grad(set_to_none=True)

    def user_step() -> None:
        train_step(fmodel, args, opt)  # type: ignore[misc]

    step = user_step if train_step is not None else builtin_step
    real_inputs = None if callable(inputs) and not isinstance(inputs, torch.Tensor) else inputs
    try:
        # transformers_real_paths: the library's value-dependent attention choices follow the real inputs,
        # so the fake step runs the kernels the real one runs (restored on exit).
        with training_without_cache(fmodel), transformers_real_paths(real_inputs), host_kernels, fake_mode, attention, recorder:
            recorder.register(list(fmodel.parameters()), PARAM)
            recorder.register(list(fmodel.buffers()), BUFFER)
            recorder.register(args, INPUT)
            say("warm-up step (creates optimizer state)")
            if train_step is not None:
                step()
            elif opt is not None:
                _warm_optimizer(fmodel, opt)
            recorder.close_segment()
            recorder.recording = True
            say("recorded step")
            step()
            recorder.close_segment(Phase.OTHER)
            recorder.recording = False
    except (CollectionError, ConfigError, UnsupportedModelError):
        raise
    except Exception as e:  # name the module that was running
        if recorder.failed_in is not None and recorder.failed_in[1] is e:
            where = recorder.failed_in[0]  # the forward hooks have unwound fw_stack by now
        else:
            where = recorder.fw_stack[-1].fqn if recorder.fw_stack else (recorder.bw_active[-1].fqn if recorder.bw_active else "")
        op = recorder.failed_op[0] if recorder.failed_op is not None and _caused_by(e, recorder.failed_op[1]) else None
        raise CollectionError(
            f"the fake training step failed in module {where or '<top level>'!r} ({type(fmodel).__name__})"
            f"{f' at {op}' if op is not None else ''}: {type(e).__name__}: {e}. {failure_hint(op, e)}"
        ) from e
    finally:
        for h in hooks:
            h.remove()
    if not recorder.calls:
        raise UnsupportedModelError(f"{model_name}: no module forward ran during the step; is the model called?")
    say("building statistics")
    stats = _build_stats(recorder, fmodel, opt, spec, model_name, dtype, args, max_lines)
    meta = dict(stats.meta)
    meta.update(
        torch_version=torch.__version__,
        collect_seconds=round(time.perf_counter() - t_start, 3),
        runtime_mode=runtime,
        host="cpu-fake",
    )
    stats = _replace(stats, meta=meta)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    if world_size > 1:
        from sacplan.distributed import shard_stats

        stats = shard_stats(stats, world_size, fsdp_units=fsdp_units, mode="ddp" if ddp else "fsdp")
    return stats


# ---------------------------------------------------------------------------------------------- build
def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A ``torch.dtype`` from a dtype or its name (``"bf16"``, ``"fp16"``, ``"fp32"`` and aliases); None stays
    None; anything else: ConfigError naming the accepted names."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
        "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    }
    key = str(dtype).lower().replace("torch.", "")
    if key not in names:
        raise ConfigError(f"unknown dtype {dtype!r}: use bf16, fp16 or fp32")
    return names[key]


def _build_fake_model(model: ModelArg, preset: Any, fake_mode: FakeTensorMode, dtype: torch.dtype | None) -> nn.Module:
    if preset is not None:
        # The preset casts itself (Llama keeps its rotary table in float32, as a real bf16 run does).
        factory: Callable[[], nn.Module] | None = lambda: preset.build(dtype=dtype)  # noqa: E731
    elif isinstance(model, nn.Module):
        factory = None
    elif callable(model):
        factory = model
    else:
        raise ConfigError(f"model must be an nn.Module, a factory returning one, or a preset name; got {type(model).__name__}")

    if factory is not None:
        try:
            with torch.device("meta"):
                m = factory()
        except Exception as on_meta:
            try:
                with fake_mode:
                    m = factory()
            except ConfigError:
                raise  # the factory's own argument checks (e.g. a bad model config)
            except Exception as on_fake:
                raise CollectionError(
                    f"the model factory failed on the meta device ({type(on_meta).__name__}: {on_meta}) and on fake "
                    f"tensors ({type(on_fake).__name__}: {on_fake}); typically its constructor reads tensor data (.item(), "
                    ".tolist(), numpy). Skip that initialisation when the weights are on 'meta' (weights are never "
                    "read during collection), or build the model yourself and pass the nn.Module."
                ) from on_fake
        if not isinstance(m, nn.Module):
            raise ConfigError(f"the model factory returned {type(m).__name__}, not an nn.Module")
    else:
        m = _meta_copy(model)  # type: ignore[arg-type]
    if dtype is not None and preset is None and any(t.is_meta for t in _tensors_of(m)):
        m = m.to(dtype)  # cast on meta: free, and avoids swapping fake tensors later
    with fake_mode:
        if any(t.is_meta for t in _tensors_of(m)):
            m = _to_empty_keep_ties(m)
        if dtype is not None and any(t.is_floating_point() and t.dtype != dtype for t in m.parameters()):
            raise UnsupportedModelError(
                f"could not cast the model to {dtype}: build it in that dtype, or pass dtype=None"
            )
    m.train()
    return m


def _to_empty_keep_ties(m: nn.Module) -> nn.Module:
    """``m.to_empty(device="cpu")`` keeping shared (tied) parameters and buffers shared.

    ``Module.to_empty`` replaces each module's tensors one slot at a time, so a weight shared by two modules
    (tied embeddings) would become two tensors: twice the parameter, gradient and optimizer bytes.
    """
    groups: dict[tuple[str, int], list[tuple[nn.Module, str]]] = {}
    for mod in m.modules():
        for kind, slots in (("p", mod._parameters), ("b", mod._buffers)):
            for name, t in slots.items():
                if t is not None:
                    groups.setdefault((kind, id(t)), []).append((mod, name))
    m = m.to_empty(device="cpu")
    for (kind, _), members in groups.items():
        if len(members) > 1:
            first_mod, first_name = members[0]
            for mod, name in members[1:]:
                if kind == "p":
                    mod._parameters[name] = first_mod._parameters[name]
                else:
                    mod._buffers[name] = first_mod._buffers[name]
    return m


def _meta_copy(model: nn.Module) -> nn.Module:
    """A structural copy of ``model`` whose parameters and buffers live on ``meta`` (no data copied)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def _tensors_of(m: nn.Module) -> list[torch.Tensor]:
    return list(m.parameters()) + list(m.buffers())


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _make_inputs(
    inputs: Any, preset: Any, fake_mode: FakeTensorMode, batch: int | None, seq: int | None, dtype: torch.dtype | None = None
) -> tuple | dict:
    if inputs is None:
        if preset is None:
            raise ConfigError("inputs are required unless the model is a built-in preset name")
        # Floating-point example inputs (images) in the model's dtype: a bf16 model fed fp32 images fails on a
        # real device, while fake tensors would silently run it in fp32 (fp32-sized activations).
        args = preset.example_inputs(batch or preset.default_batch, seq, dtype=dtype)
    elif callable(inputs) and not isinstance(inputs, torch.Tensor):
        args = inputs()
    else:
        args = inputs
    args = as_inputs(args)

    def fake(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not _is_fake(x):
            return fake_mode.from_tensor(x)
        return x

    return tree_map(fake, args)


def _warm_optimizer(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Create optimizer state without a forward/backward: zero grads, one step, grads dropped."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _install_state_hooks(
    model: nn.Module, opt: torch.optim.Optimizer | None, rec: StepRecorder, cuda_target: bool = False
) -> list[Any]:
    handles = []
    for p in model.parameters():
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(lambda p: rec.relabel(p.grad, GRAD)))
    if opt is not None:

        def pre(o: Any, args: Any, kwargs: Any) -> None:
            rec.close_segment(Phase.BW if not rec.in_optimizer else Phase.OTHER)
            rec.in_optimizer = True

        def post(o: Any, args: Any, kwargs: Any) -> None:
            for state in o.state.values():
                rec.relabel([v for v in state.values() if isinstance(v, torch.Tensor)], OPT)
            if cuda_target:
                rec.untrack(host_state_tensors(o))
            rec.close_segment(Phase.OTHER)
            rec.in_optimizer = False

        handles.append(opt.register_step_pre_hook(pre))
        handles.append(opt.register_step_post_hook(post))
    return handles


# ---------------------------------------------------------------------------------------------- stats
def _snap(cats: tuple[int, ...]) -> MemSnapshot:
    return MemSnapshot(**dict(zip(CATEGORIES, cats)))


def _op_stats(rec: CallRecord, recorder: StepRecorder) -> tuple[tuple[OpStat, ...], int]:
    ops = recorder.ops[rec.op_start : rec.op_end]
    packed = recorder.packed_sids
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
        result.append(
            OpStat(
                index=k, name=name, occurrence=occ, out_bytes=o.new_bytes, runtime_ms=o.ms, flops=o.flops,
                is_view=o.is_view, is_random=o.is_random, inplace_of=parent, saved_by_autograd=saved,
                is_output=is_out, save_cost_bytes=cost if not o.is_view else 0,
                below_peak_bytes=max(0, peak - o.live),
            )
        )
    stop = max(0, rec.last_pack - rec.op_start) if rec.last_pack >= 0 else 0
    return tuple(result), min(stop, len(result))


def _static_bytes(model: nn.Module, opt: torch.optim.Optimizer | None, spec: DeviceSpec) -> dict[str, tuple[int, int, int]]:
    opt_bytes: dict[int, int] = {}
    if opt is not None:
        # a CUDA target keeps non-capturable optimizers' step scalars on the host (sacplan.collect.kernels)
        host = {id(t) for t in host_state_tensors(opt)} if spec.attention == "flash" else set()
        for p, state in opt.state.items():
            opt_bytes[id(p)] = sum(
                spec.round_alloc(v.untyped_storage().nbytes())
                for v in state.values()
                if isinstance(v, torch.Tensor) and id(v) not in host
            )
    out = {}
    for name, mod in model.named_modules():
        pb = gb = ob = 0
        for p in mod.parameters():
            b = spec.round_alloc(p.untyped_storage().nbytes())
            pb += b
            if p.requires_grad:
                gb += b
            ob += opt_bytes.get(id(p), 0)
        bb = sum(spec.round_alloc(b.untyped_storage().nbytes()) for b in mod.buffers())
        out[name] = (pb, gb, ob, bb)
    return out


def _merge_events(recorder: StepRecorder) -> tuple[MemoryEvent, ...]:
    """Segments → events; neighbouring segments with the same counters keep only their peak."""
    events: list[MemoryEvent] = []
    for s in recorder.segments:
        state = s.cats[PARAM] + s.cats[GRAD] + s.cats[OPT]
        ev = MemoryEvent(s.phase, s.module, s.call, s.fw_done, s.bw_started if s.phase != Phase.FW else 0, s.peak, state, s.extra,
                         bw_done=s.bw_done if s.phase != Phase.FW else 0)
        if events and s.phase != Phase.RC:
            last = events[-1]
            if (last.phase, last.fw_done, last.bw_started, last.bw_done) == (ev.phase, ev.fw_done, ev.bw_started, ev.bw_done):
                if ev.peak_bytes > last.peak_bytes:
                    events[-1] = ev
                continue
        events.append(ev)
    return tuple(events)


def _build_stats(
    recorder: StepRecorder,
    model: nn.Module,
    opt: torch.optim.Optimizer | None,
    spec: DeviceSpec,
    model_name: str,
    dtype: torch.dtype | None,
    args: tuple,
    max_lines: int,
) -> ModelStats:
    by_fqn: dict[str, list[CallRecord]] = {}
    for rec in recorder.calls:
        by_fqn.setdefault(rec.fqn, []).append(rec)
    has_children = {rec.parent.fqn for rec in recorder.calls if rec.parent is not None}
    static = _static_bytes(model, opt, spec)
    modules = []
    for fqn, recs in by_fqn.items():
        first = recs[0]
        ops, stop = _op_stats(first, recorder)
        tradeoff = build_tradeoff(ops, first.act_kept, stop, max_lines)
        discardable = []
        for r in recs:
            if r is first:
                discardable.append(tradeoff.max_discard_bytes if tradeoff is not None else 0)
            else:
                o2, s2 = _op_stats(r, recorder)
                t2 = build_tradeoff(o2, r.act_kept, s2, max_lines)
                discardable.append(t2.max_discard_bytes if t2 is not None else 0)
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


def _replace(stats: ModelStats, **changes: Any) -> ModelStats:
    import dataclasses

    return dataclasses.replace(stats, **changes)


def _caused_by(e: BaseException, cause: BaseException) -> bool:
    """True when ``cause`` is ``e`` or in its chain of causes / contexts."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if cur is cause:
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def failure_hint(op: Any, e: BaseException) -> str:
    """What to do when the fake step fails in aten op ``op`` (None: not in an op) with ``e``."""
    name = str(op) if op is not None else ""
    text = str(e)
    if "_grouped_mm" in name and "BF16" in text:
        return ("PyTorch's fake (meta) kernel of aten._grouped_mm accepts only bf16 inputs (the real CPU kernel also "
                "runs fp32): collect in bf16 (dtype=torch.bfloat16, what a GPU target runs), or pick a dense experts "
                "kernel (transformers: config._experts_implementation = 'batched_mm').")
    if type(e).__name__ == "DynamicOutputShapeException" or "nonzero" in name:
        return (f"{name or 'an op'} has an output shape that depends on tensor values, which fake tensors do not have "
                "(a per-expert loop, boolean masking): choose a code path without it (transformers mixture-of-experts: "
                "config._experts_implementation = 'batched_mm'), or pass a train_step that avoids it.")
    return ("If the model's constructor or forward needs real data (data-dependent control flow, .item(), numpy), "
            "pass a factory that builds it on the meta device, or a train_step that avoids it.")

