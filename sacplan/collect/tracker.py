"""One dispatch mode that records memory, runtime and per-op SAC facts of a training step.

:class:`StepRecorder` is a ``TorchDispatchMode`` plus global module hooks. Per aten op it

* registers every *new* output storage with the category of the phase it was made in
  (forward → activation, backward → temp, optimizer step → temp; gradients and optimizer state are
  re-labelled when autograd / the optimizer adopt them) and the target allocator's rounded size;
  a ``weakref.finalize`` on the storage takes it off when it dies;
* keeps the live bytes per category as running totals, so every hook and op is O(1) in the model size
  (PyTorch's ``MemTracker`` walks all tracked tensors per snapshot, which is why it slows superlinearly);
* estimates the op's time on the target (:class:`~sacplan.collect.runtime.RuntimeModel`) and adds it to
  the active modules;
* in forward, appends an op record (output bytes, view / in-place / random flags, FLOPs) to one global
  list; each module call remembers its contiguous slice of it.

Module hooks mark the timeline: every forward pre/post and backward pre/post closes a *segment* whose
peak becomes a :class:`~sacplan.stats.MemoryEvent`.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from sacplan.collect.runtime import RuntimeModel, op_flops
from sacplan.collect.workspace import WORKSPACE_OPS, workspace_bytes
from sacplan.devices import DeviceSpec
from sacplan.stats import CATEGORIES, Phase

try:  # torch >= 2.4
    from torch.utils.checkpoint import SAC_IGNORED_OPS as _SAC_IGNORED
except ImportError:  # pragma: no cover - older torch
    _SAC_IGNORED = {torch.ops.aten.detach.default}

aten = torch.ops.aten
CAT = {name: i for i, name in enumerate(CATEGORIES)}
PARAM, BUFFER, GRAD, OPT, INPUT, ACT, TEMP, OTHER = (CAT[c] for c in CATEGORIES)
#: profiler markers (``record_function`` in ``Optimizer.step``/``zero_grad`` or user code): no kernel, no
#: memory and no time on any device, so they are neither timed nor recorded as forward ops.
_PROFILER_OPS = frozenset(
    getattr(getattr(torch.ops.profiler, packet, None), overload, None)
    for packet, overload in (
        ("_record_function_enter", "default"),
        ("_record_function_enter_new", "default"),
        ("_record_function_exit", "default"),
        ("_record_function_exit", "_RecordFunction"),
    )
) - {None}
#: ops never offered to a selective-checkpoint policy (PyTorch skips them too), and profiler markers.
IGNORED_OPS = frozenset(_SAC_IGNORED) | {aten.lift_fresh.default} | _PROFILER_OPS

_VIEW_CACHE: dict[Any, tuple[bool, bool]] = {}


def op_kind(func: Any) -> tuple[bool, bool]:
    """``(is_view, is_inplace)`` of an aten overload, read from its schema (cached)."""
    kind = _VIEW_CACHE.get(func)
    if kind is None:
        schema = func._schema
        is_inplace = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        is_view = (not is_inplace) and any(r.alias_info is not None for r in schema.returns)
        kind = (is_view, is_inplace)
        _VIEW_CACHE[func] = kind
    return kind


def storages_of(x: Any) -> list[torch.UntypedStorage]:
    """Untyped storages of every tensor in a pytree (sparse/nested tensors give none)."""
    flat, _ = tree_flatten(x)
    out = []
    for t in flat:
        if isinstance(t, torch.Tensor) and t.layout == torch.strided:
            try:
                out.append(t.untyped_storage())
            except (RuntimeError, NotImplementedError):
                pass
    return out


@dataclass
class OpRecord:
    """A forward op as recorded (indices are global over the step's forward ops)."""

    func: Any
    new_bytes: int
    out_sids: tuple[int, ...]  #: storage keys (see ``StepRecorder.storage_key``), not ``id()``s
    ms: float
    flops: int
    is_view: bool
    is_inplace: bool
    is_random: bool
    inplace_parent: int | None
    #: bytes each output storage added (parallel to ``out_sids``; 0 where the storage existed before the op)
    out_new: tuple[int, ...] = ()
    #: live bytes just after the op (outputs allocated, inputs not yet released) plus its kernel scratch
    live: int = 0


@dataclass
class CallRecord:
    """One call of one module during the recorded step."""

    fqn: str
    call: int
    parent: "CallRecord | None"
    depth: int
    op_start: int
    event_fw_start: int
    op_end: int = -1
    last_pack: int = -1
    pre_fw: tuple[int, ...] = ()
    post_fw: tuple[int, ...] = ()
    peak_fw: tuple[int, ...] = ()
    pre_bw: tuple[int, ...] = ()
    post_bw: tuple[int, ...] = ()
    peak_bw: tuple[int, ...] = ()
    event_bw_start: int = -1
    alloc_seq_pre: int = 0
    act_alloc_pre: int = 0
    act_freed_inside: int = 0
    act_kept: int = 0
    out_sids: tuple[int, ...] = ()  #: storage keys of the output (see ``StepRecorder.storage_key``)
    out_new_bytes: int = 0
    #: global index of the last forward op that made a new output storage (-1: none)
    out_op: int = -1
    input_bytes: int = 0
    #: bytes of the inputs' storages the step did not allocate: its own example inputs and untracked tensors
    input_external_bytes: int = 0
    #: ``(storage key, bytes)`` of the tracked activation storages among the call's tensor inputs
    input_keys: tuple[tuple[int, int], ...] = ()
    output_bytes: int = 0
    fw_ms: float = 0.0
    bw_ms: float = 0.0
    fw_flops: int = 0
    bw_flops: int = 0
    bw_done: bool = False
    bw_post_fn: Any = None  # the live backward-post callback (a later one supersedes it)
    #: parameters whose accumulated gradients end this call's backward (no input of it needs a gradient)
    end_params: tuple = ()


@dataclass
class Segment:
    phase: str
    module: str
    call: int
    fw_done: int
    bw_started: int
    peak: int
    cats: tuple[int, ...]
    extra: int = 0
    bw_done: int = 0  #: entries of ``bw_post_order`` completed before the stretch


class StepRecorder(TorchDispatchMode):
    """Records one training step (see module docstring). Use as a context manager around the step.

    Args:
        model: the model (its module names become fqns; the root is ``""``).
        spec: the target device (allocator rounding, roofline figures).
        runtime: the runtime model.
        sdpa_random_hint: callable returning True once if the next attention kernel was called with dropout.
    """

    def __init__(self, model: nn.Module, spec: DeviceSpec, runtime: RuntimeModel) -> None:
        super().__init__()
        self.model = model
        self.spec = spec
        self.runtime = runtime
        self.fqn_of: dict[nn.Module, str] = {}
        for name, mod in model.named_modules(remove_duplicate=False):
            self.fqn_of.setdefault(mod, name)
        self.live = [0] * len(CATEGORIES)
        self.total = 0
        self.storages: dict[int, list[int]] = {}  # sid -> [nbytes, category, alloc seq, category at alloc]
        self.act_alloc_total = 0  # cumulative activation bytes allocated (for per-call kept bytes)
        self.sid_creator: dict[int, int] = {}  # sid -> global forward op index that created it
        self.alloc_seq = 0
        self.recording = False
        self.in_optimizer = False
        self.next_sdpa_random = False
        # timeline
        self.segments: list[Segment] = []
        self.seg_peak = 0
        self.seg_cats: tuple[int, ...] = tuple(self.live)
        self.step_peak = 0
        self.step_peak_cats: tuple[int, ...] = tuple(self.live)
        self.step_peak_where: tuple[str, str] = (Phase.FW, "")
        # module calls
        self.calls: list[CallRecord] = []
        self.call_count: dict[str, int] = {}
        self.fw_stack: list[CallRecord] = []
        self.bw_active: list[CallRecord] = []
        self.failed_op: tuple[Any, BaseException] | None = None
        self.fw_pre_order: list[str] = []
        self.fw_post_order: list[str] = []
        self.bw_pre_order: list[str] = []
        self.bw_post_order: list[str] = []
        # forward ops
        self.ops: list[OpRecord] = []
        self.packed_sids: set[int] = set()  # storage keys of the tensors autograd saved
        #: storage keys freed during the recorded forward (before any backward op ran)
        self.freed_in_fw: set[int] = set()
        self.bw_seen = False
        # totals
        self.fw_ms = self.bw_ms = self.opt_ms = 0.0
        self.fw_flops = self.bw_flops = 0
        self._undo: contextlib.ExitStack | None = None
        self._pending_bw_post: list[Callable[[], None]] = []
        self._callback_queued = False
        #: ``(fqn, exception)`` of the innermost module whose forward raised (set while the exception unwinds).
        self.failed_in: tuple[str, BaseException] | None = None

    # ------------------------------------------------------------------ storage accounting --------
    def register(self, t: Any, category: int) -> None:
        """Track the storages of tensors in ``t`` under ``category`` (re-label if already tracked)."""
        for st in storages_of(t):
            self._add_storage(st, category)

    def _add_storage(self, st: torch.UntypedStorage, category: int) -> int:
        sid = id(st)
        info = self.storages.get(sid)
        if info is not None:
            if info[1] != category:
                self.live[info[1]] -= info[0]
                self.live[category] += info[0]
                info[1] = category
            return 0
        nbytes = self.spec.round_alloc(st.nbytes())
        self.alloc_seq += 1
        self.storages[sid] = [nbytes, category, self.alloc_seq, category]
        if category == ACT:
            self.act_alloc_total += nbytes
        weakref.finalize(st, self._free, sid)
        self.live[category] += nbytes
        self.total += nbytes
        if self.total > self.seg_peak:
            self.seg_peak = self.total
            self.seg_cats = tuple(self.live)
        return nbytes

    def storage_key(self, st: torch.UntypedStorage) -> int | None:
        """A key for a tracked storage that no other storage of this step shares (``None`` if untracked).

        ``id(st)`` identifies a storage only while it lives: CPython hands the address of a dead storage to
        the next object, so op outputs and saved tensors compared by ``id`` after the step matched storages
        that merely reused a dead one's address, and ``saved_by_autograd`` / ``is_output`` varied from run to
        run. The allocation sequence number is unique over the recorder's life.
        """
        info = self.storages.get(id(st))
        return None if info is None else info[2]

    def _free(self, sid: int) -> None:
        info = self.storages.pop(sid, None)
        if info is not None:
            if self.recording and not self.bw_seen and torch._C._current_graph_task_id() == -1:
                self.freed_in_fw.add(info[2])
            self.live[info[1]] -= info[0]
            self.total -= info[0]
            if info[3] == ACT:
                # Charge the free to every open forward call that allocated this storage (O(depth)).
                for rec in reversed(self.fw_stack):
                    if info[2] <= rec.alloc_seq_pre:
                        break
                    rec.act_freed_inside += info[0]
        self.sid_creator.pop(sid, None)

    def relabel(self, t: Any, category: int) -> None:
        """Move already-tracked storages of ``t`` to ``category`` (untracked ones are added)."""
        self.register(t, category)

    def untrack(self, t: Any) -> None:
        """Count the storages of ``t`` as 0 device bytes from now on (they live on the target's host)."""
        for st in storages_of(t):
            info = self.storages.get(id(st))
            if info is not None and info[0]:
                self.live[info[1]] -= info[0]
                self.total -= info[0]
                info[0] = 0

    def _activation_keys(self, x: Any) -> tuple[tuple[int, int], ...]:
        """``(storage key, bytes)`` of each distinct activation storage (made by this step's forward) in ``x``."""
        out: dict[int, int] = {}
        for st in storages_of(x):
            info = self.storages.get(id(st))
            if info is not None and info[3] == ACT:
                out[info[2]] = info[0]
        return tuple(out.items())

    def _external_bytes(self, x: Any) -> int:
        """Bytes (allocator-rounded, as :func:`_tensor_bytes_of` counts them) of the distinct storages in ``x``
        that the step did not allocate: the example inputs (category ``input``) and tensors made before the
        step that are neither parameters nor buffers (untracked)."""
        seen: set[int] = set()
        total = 0
        for st in storages_of(x):
            if id(st) in seen:
                continue
            seen.add(id(st))
            info = self.storages.get(id(st))
            if info is None or info[1] == INPUT:
                total += self.spec.round_alloc(st.nbytes())
        return total

    def held_by_checkpoint(self, rec: CallRecord) -> int:
        """Bytes a non-reentrant checkpoint of ``rec`` would keep besides saved tensors: its activation inputs
        that the step freed before backward began (nothing saved them). ``torch.utils.checkpoint`` holds a
        region's inputs until the region's backward to re-run it; inputs something saves live that long anyway."""
        return sum(b for k, b in rec.input_keys if k in self.freed_in_fw)

    def snapshot(self) -> tuple[int, ...]:
        return tuple(self.live)

    # ------------------------------------------------------------------ timeline ------------------
    def _phase(self) -> str:
        if self.in_optimizer:
            return Phase.OTHER
        return Phase.BW if torch._C._current_graph_task_id() != -1 else Phase.FW

    def close_segment(self, phase: str | None = None) -> None:
        """End the current stretch of the timeline and start a new one at the current live bytes."""
        if self.recording:
            phase = phase or self._phase()
            if self.fw_stack and phase == Phase.FW:
                mod, call = self.fw_stack[-1].fqn, self.fw_stack[-1].call
            elif self.bw_active and phase == Phase.BW:
                mod, call = self.bw_active[-1].fqn, self.bw_active[-1].call
            else:
                mod, call = "", 0
            self.segments.append(
                Segment(phase, mod, call, len(self.fw_post_order), len(self.bw_pre_order), self.seg_peak, self.seg_cats,
                        bw_done=len(self.bw_post_order))
            )
            if self.seg_peak > self.step_peak:
                self.step_peak = self.seg_peak
                self.step_peak_cats = self.seg_cats
                self.step_peak_where = (phase, mod)
        self.seg_peak = self.total
        self.seg_cats = tuple(self.live)

    # ------------------------------------------------------------------ dispatch ------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except Exception as e:
            self.failed_op = (func, e)  # the op a failing step died in (collect names it)
            raise
        if func in IGNORED_OPS:
            return out
        is_view, is_inplace = op_kind(func)
        new_bytes = 0
        out_sids = []
        in_bw = torch._C._current_graph_task_id() != -1
        if in_bw and self.recording:
            self.bw_seen = True
        category = TEMP if (in_bw or self.in_optimizer) else ACT
        fresh = 0
        out_new = []
        for st in storages_of(out):
            sid = id(st)
            out_sids.append(sid)
            if sid not in self.storages:
                fresh += 1
                out_new.append(self._add_storage(st, category))
                new_bytes += out_new[-1]
            else:
                out_new.append(0)
        out_keys = tuple(self.storages[sid][2] for sid in out_sids)
        ws = workspace_bytes(self.spec, func, args, kwargs, out) if func in WORKSPACE_OPS else 0
        if ws and self.total + ws > self.seg_peak:
            self.seg_peak = self.total + ws
            cats = list(self.live)
            cats[TEMP] += ws
            self.seg_cats = tuple(cats)
        if not self.recording:
            return out
        if out_sids and not fresh and not is_inplace:
            # Returns only aliases of existing storages without declaring it (``_unsafe_view``, no-op ``to``):
            # a view in all but schema. Saving it under SAC would pin its base, so it is treated as a view.
            is_view = True
        flops = op_flops(func, args, kwargs, out)
        ms = self.runtime.estimate(func, args, kwargs, out, flops, is_view)
        if self.in_optimizer:
            self.opt_ms += ms
        elif in_bw:
            self.bw_ms += ms
            self.bw_flops += flops
            for rec in self.bw_active:
                rec.bw_ms += ms
                rec.bw_flops += flops
        else:
            self.fw_ms += ms
            self.fw_flops += flops
            g = len(self.ops)
            is_random = torch.Tag.nondeterministic_seeded in func.tags
            if func._overloadpacket in _ATTENTION_PACKETS:
                # SDPA kernels carry the seeded tag; they are random only when called with dropout.
                is_random = self.next_sdpa_random or _dropout_arg(func, args, kwargs) > 0
                self.next_sdpa_random = False
            parent = None
            if is_inplace:
                for sid in out_sids:
                    if sid in self.sid_creator:
                        parent = self.sid_creator[sid]
                        break
            for sid in out_sids:
                self.sid_creator.setdefault(sid, g)
            self.ops.append(OpRecord(func, new_bytes, out_keys, ms, flops, is_view, is_inplace, is_random, parent, tuple(out_new),
                                     self.total + ws))
            for rec in self.fw_stack:
                rec.fw_ms += ms
                rec.fw_flops += flops
        return out

    # ------------------------------------------------------------------ autograd pack hook --------
    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.recording and torch._C._current_graph_task_id() == -1:
            try:
                key = self.storage_key(t.untyped_storage())
            except (RuntimeError, NotImplementedError):
                key = None
            if key is not None:
                self.packed_sids.add(key)
            n = len(self.ops)
            for rec in self.fw_stack:
                rec.last_pack = n
        return t

    # ------------------------------------------------------------------ module hooks --------------
    def _fw_pre(self, mod: nn.Module, inputs: Any) -> None:
        fqn = self.fqn_of.get(mod)
        if fqn is None or torch._C._current_graph_task_id() != -1:
            return  # a module of another model, or a forward re-run inside backward
        if not self.recording:
            self._register_bw_post(mod, fqn, inputs, None)
            return
        self.close_segment(Phase.FW)
        call = self.call_count.get(fqn, 0)
        self.call_count[fqn] = call + 1
        parent = self.fw_stack[-1] if self.fw_stack else None
        rec = CallRecord(
            fqn=fqn,
            call=call,
            parent=parent,
            depth=len(self.fw_stack),
            op_start=len(self.ops),
            event_fw_start=len(self.segments),
            pre_fw=self.snapshot(),
            alloc_seq_pre=self.alloc_seq,
            act_alloc_pre=self.act_alloc_total,
            input_bytes=_tensor_bytes_of(inputs, self.spec),
            input_external_bytes=self._external_bytes(inputs),
            input_keys=self._activation_keys(inputs),
        )
        self.calls.append(rec)
        self.fw_stack.append(rec)
        self.fw_pre_order.append(fqn)
        self._register_bw_post(mod, fqn, inputs, rec)

    def _fw_post(self, mod: nn.Module, inputs: Any, *rest: Any) -> None:
        # Registered with_kwargs: ``(mod, args, kwargs, output)``; when the forward raised, PyTorch calls
        # always-call global hooks as ``(mod, args, None)`` from inside its ``except`` block.
        kwargs, output = rest if len(rest) == 2 else ({}, rest[0])
        fqn = self.fqn_of.get(mod)
        if fqn is None or torch._C._current_graph_task_id() != -1:
            return
        exc = sys.exc_info()[1]
        if exc is not None and (self.failed_in is None or self.failed_in[1] is not exc):
            self.failed_in = (fqn, exc)  # the first module to unwind is the innermost one
        if not self.recording:
            self._register_bw_pre(mod, output, None)
            return
        if not self.fw_stack or self.fw_stack[-1].fqn != fqn:
            return  # unbalanced (forward raised in a child); ignore
        rec = self.fw_stack[-1]
        self.close_segment(Phase.FW)
        rec.op_end = len(self.ops)
        rec.post_fw = self.snapshot()
        peak = max((self.segments[i] for i in range(rec.event_fw_start, len(self.segments))), key=lambda s: s.peak, default=None)
        rec.peak_fw = peak.cats if peak is not None and peak.peak > sum(rec.post_fw) else rec.post_fw
        sids = []
        new_out = 0
        for st in storages_of(output):
            info = self.storages.get(id(st))
            if info is None:
                continue
            sids.append(info[2])
            if info[2] > rec.alloc_seq_pre and info[1] == ACT:
                new_out += info[0]
                rec.out_op = max(rec.out_op, self.sid_creator.get(id(st), -1))
        rec.out_sids = tuple(sids)
        rec.out_new_bytes = new_out
        kept = self.act_alloc_total - rec.act_alloc_pre - rec.act_freed_inside
        rec.act_kept = max(0, kept - new_out)
        rec.output_bytes = _tensor_bytes_of(output, self.spec)
        if kwargs:
            # Tensors passed by keyword are inputs too (the global pre-hook only sees positional ones):
            # count them, and end this call's backward when their gradients are done as well.
            rec.input_bytes = _tensor_bytes_of((inputs, kwargs), self.spec)
            rec.input_external_bytes = self._external_bytes((inputs, kwargs))
            rec.input_keys = self._activation_keys((inputs, kwargs))
            flat, _ = tree_flatten(kwargs)
            if any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat):
                self._register_bw_post(mod, fqn, (inputs, kwargs), rec)
        if rec.end_params and rec.bw_post_fn is not None:
            self._end_with_parameters(list(rec.end_params), rec.bw_post_fn)
        self.fw_stack.pop()
        self.fw_post_order.append(fqn)
        self._register_bw_pre(mod, output, rec)

    def _register_bw_pre(self, mod: nn.Module, output: Any, rec: CallRecord | None) -> None:
        flat, _ = tree_flatten(output)
        tensors = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            return

        def hook(grads: Any) -> None:
            self._maybe_queue_callback()
            if rec is None or not self.recording:
                return
            self.close_segment(Phase.BW)
            rec.pre_bw = self.snapshot()
            rec.event_bw_start = len(self.segments)
            self.bw_pre_order.append(rec.fqn)
            self.bw_active.append(rec)
            # Recomputing this call's forward (if checkpointed) would happen here. It re-runs the ops up to the last
            # one that saved a tensor (early stop) and holds, at its highest, what the forward held at its highest
            # among those ops above the call's start; the events after it count the saved tensors (S = post -
            # output) as back, so the transient beyond them is max_t live_t - (post_fw - output). The output is
            # not part of S: it is in the base only where something still holds it, and a recomputation that
            # re-runs the op making it allocates a fresh copy (counted in live_t).
            ran = self.ops[rec.op_start : rec.last_pack] if rec.last_pack > rec.op_start else []
            top = max((o.live for o in ran), default=0)
            extra = max(0, top - (sum(rec.post_fw) - rec.out_new_bytes)) if ran else 0
            self.segments.append(
                Segment(Phase.RC, rec.fqn, rec.call, len(self.fw_post_order), len(self.bw_pre_order), self.total, tuple(self.live),
                        extra=extra, bw_done=len(self.bw_post_order))
            )

        register_multi_grad_hook(tensors, hook, mode="any")

    def _register_bw_post(self, mod: nn.Module, fqn: str, inputs: Any, rec: CallRecord | None) -> None:
        flat, _ = tree_flatten(inputs)
        tensors = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]

        def done(*_: Any) -> None:
            if rec is None or rec.bw_done or not self.recording or rec.event_bw_start < 0:
                return
            if rec.bw_post_fn is not done:
                return  # superseded by a registration that also waits for keyword-argument gradients
            rec.bw_done = True
            self.close_segment(Phase.BW)
            rec.post_bw = self.snapshot()
            span = self.segments[rec.event_bw_start :]
            peak = max((s for s in span if s.phase == Phase.BW), key=lambda s: s.peak, default=None)
            rec.peak_bw = peak.cats if peak is not None and peak.peak > sum(rec.pre_bw) else rec.pre_bw
            self.bw_post_order.append(rec.fqn)
            if rec in self.bw_active:
                self.bw_active.remove(rec)

        if rec is not None:
            rec.bw_post_fn = done
        params = [p for p in mod.parameters() if p.requires_grad] if not tensors else []
        if rec is not None:
            rec.end_params = ()
        if tensors:
            register_multi_grad_hook(tensors, done, mode="all")
        elif params and rec is not None:
            rec.end_params = tuple(params)  # hooked at the call's forward end, so nested calls end first
        else:
            self._pending_bw_post.append(done)

    def _end_with_parameters(self, params: list[torch.Tensor], done: Callable[[], None]) -> None:
        """A call none of whose inputs needs a gradient ends its backward once its parameters' gradients are
        accumulated (a module called more than once: once all its calls' are, a conservative end), or, for
        parameters the step leaves without a gradient, at the end of the whole backward. Post-accumulate hooks,
        not a multi-grad hook: those would hold the gradients until all arrive and change the peak measured."""
        left = [len(params)]
        handles: list[Any] = []

        def finish() -> None:
            for h in handles:
                h.remove()
            handles.clear()
            done()

        def one(_: torch.Tensor) -> None:
            left[0] -= 1
            if left[0] == 0:
                finish()

        handles.extend(p.register_post_accumulate_grad_hook(one) for p in params)
        self._pending_bw_post.append(finish)

    def _maybe_queue_callback(self) -> None:
        if self._callback_queued:
            return
        self._callback_queued = True
        engine = torch.autograd.Variable._execution_engine
        for cb in reversed(self._pending_bw_post):
            engine.queue_callback(cb)
        self._pending_bw_post.clear()

        def reset() -> None:
            self._callback_queued = False

        engine.queue_callback(reset)

    # ------------------------------------------------------------------ context -------------------
    def __enter__(self) -> "StepRecorder":
        # Everything global this installs is undone by ``self._undo`` (last in, first out), also when entering
        # fails halfway: after the step every global hook dict, ``UntypedStorage.resize_`` and the saved-tensor
        # hooks stack are as they were (tests/collect/test_global_state.py).
        with contextlib.ExitStack() as undo:
            undo.callback(_remove_global_hook, register_module_forward_pre_hook(self._fw_pre))
            post = register_module_forward_hook(self._fw_post, with_kwargs=True, always_call=True)
            undo.callback(_remove_global_hook, post)
            undo.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack))
            self._install_resize_hook()
            undo.callback(self._restore_resize)
            out = super().__enter__()
            self._undo = undo.pop_all()
        return out

    def _install_resize_hook(self) -> None:
        """See ``UntypedStorage.resize_``: FSDP2 allocates and frees unsharded parameters and its all-gather
        buffers by resizing storages, which no dispatch mode observes."""
        orig = torch.UntypedStorage.resize_
        rec = self

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = orig(st, size)
            info = rec.storages.get(id(st))
            if info is None:
                if st.nbytes() > 0:
                    rec._add_storage(st, OTHER)
            else:
                new = rec.spec.round_alloc(st.nbytes())
                d = new - info[0]
                info[0] = new
                rec.live[info[1]] += d
                rec.total += d
                if rec.total > rec.seg_peak:
                    rec.seg_peak = rec.total
                    rec.seg_cats = tuple(rec.live)
            return out

        self._orig_resize = orig
        self._resize_was_own = "resize_" in vars(torch.UntypedStorage)
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]

    def _restore_resize(self) -> None:
        if self._resize_was_own:
            torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        else:  # inherited from torch._C.StorageBase: assigning it back would shadow the base class's
            del torch.UntypedStorage.resize_

    def __exit__(self, *exc: Any) -> None:
        undo, self._undo = self._undo, None
        try:
            super().__exit__(*exc)
        finally:
            if undo is not None:
                undo.close()


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _remove_global_hook(handle: Any) -> None:
    """``handle.remove()`` for a global module hook, its ``with_kwargs`` flag included.

    ``register_module_forward_hook`` files the flag in ``_global_forward_hooks_with_kwargs`` but hands back a
    handle whose ``extra_dict`` lists only ``_global_forward_hooks_always_called`` (torch 2.13), so
    ``remove()`` left ``{id: True}`` behind. That alone keeps ``_has_any_global_hook()`` true, and every
    ``torch.compile``d module then warns about global hooks on each call.
    """
    handle.remove()
    torch.nn.modules.module._global_forward_hooks_with_kwargs.pop(handle.id, None)


_ATTENTION_PACKETS = {
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
}


def _dropout_arg(func: Any, args: tuple, kwargs: dict) -> float:
    if "dropout_p" in kwargs:
        return float(kwargs["dropout_p"])
    for i, a in enumerate(func._schema.arguments):
        if a.name == "dropout_p" and i < len(args):
            return float(args[i])
    return 0.0


def _tensor_bytes_of(x: Any, spec: DeviceSpec) -> int:
    seen: set[int] = set()
    total = 0
    for st in storages_of(x):
        if id(st) not in seen:
            seen.add(id(st))
            total += spec.round_alloc(st.nbytes())
    return total
