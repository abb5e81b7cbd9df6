"""Module hooks that mark each module call on the step's timeline: the middle layer of
:class:`~sacplan.collector.tracker.StepRecorder`.

Global forward pre/post hooks (:meth:`ModuleCallHooks.install_module_hooks`) open and close a
:class:`~sacplan.collector.records.CallRecord` per module call of the recorded step; gradient hooks on the call's
outputs and inputs mark its backward's start and end. Every such moment closes a segment of the timeline
(:meth:`~sacplan.collector.storage.StorageAccounting.close_segment`), and the call record keeps the per-category
bytes before, at the peak of and after its forward and backward, its slice of the step's forward ops, and
what its inputs and outputs hold. Outside the recorded step (the warm-up) the hooks register the same
gradient hooks, which then record nothing.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._pytree import tree_flatten

from sacplan.collector.autocast import autocast_caching
from sacplan.collector.records import ACT, INPUT, CallRecord, OpRecord, Segment
from sacplan.collector.storage import StorageAccounting, storages_of, tensor_bytes_of
from sacplan.devices import DeviceSpec
from sacplan.stats import Phase


class ModuleCallHooks(StorageAccounting):
    """The module-call bookkeeping of the recorder (see module docstring).

    Args:
        model: the model (its module names become fqns; the root is ``""``).
        spec: the target device (allocator rounding).
    """

    #: the step's forward ops, appended by the recorder's dispatch mode; each call record owns a slice of it
    ops: list[OpRecord]
    #: per storage key, ``len(ops)`` at each forward pack of it (kept by the recorder's autograd pack hook)
    packed_at: dict[int, list[int]]

    def __init__(self, model: nn.Module, spec: DeviceSpec) -> None:
        super().__init__(spec)
        self.model = model
        self.fqn_of: dict[nn.Module, str] = {}
        for name, mod in model.named_modules(remove_duplicate=False):
            self.fqn_of.setdefault(mod, name)
        self.calls: list[CallRecord] = []
        self.call_count: dict[str, int] = {}
        self._pending_bw_post: list[Callable[[], None]] = []
        #: calls whose backward began and that have not read back a tensor they saved yet (:meth:`note_unpack`)
        self.rc_pending: list[CallRecord] = []
        self._callback_queued = False
        #: ``(fqn, exception)`` of the innermost module whose forward raised (set while the exception unwinds).
        self.failed_in: tuple[str, BaseException] | None = None

    def install_module_hooks(self, undo: contextlib.ExitStack) -> None:
        """Register the global forward pre/post hooks; ``undo`` removes them.

        A module with forward pre-hooks of its own (tensor parallel input layouts, FSDP2's all-gather, spectral
        norm...) starts its call in a pre-hook appended after them instead: ``apply_plan`` replaces only
        ``forward``, so what those hooks compute is the checkpointed forward's *input* (kept, never recomputed)
        and belongs to the caller, as its forward hooks' work already does (global post-hooks run first).
        """
        self._deferred: set[nn.Module] = set()
        for mod in self.fqn_of:
            if mod._forward_pre_hooks:
                self._deferred.add(mod)
                undo.callback(mod.register_forward_pre_hook(self._fw_pre_deferred).remove)
        undo.callback(_remove_global_hook, register_module_forward_pre_hook(self._fw_pre))
        post = register_module_forward_hook(self._fw_post, with_kwargs=True, always_call=True)
        undo.callback(_remove_global_hook, post)

    # ------------------------------------------------------------------ a call's inputs -----------
    def _activation_keys(self, x: Any) -> tuple[tuple[int, int], ...]:
        """``(storage key, bytes)`` of each distinct activation storage (made by this step's forward) in ``x``."""
        out: dict[int, int] = {}
        for st in storages_of(x):
            info = self.storages.get(id(st))
            if info is not None and info[3] == ACT:
                out[info[2]] = info[0]
        return tuple(out.items())

    def _external_bytes(self, x: Any) -> int:
        """Bytes (allocator-rounded, as :func:`~sacplan.collector.storage.tensor_bytes_of` counts them) of the
        distinct storages in ``x`` that the step did not allocate: the example inputs (category ``input``) and
        tensors made before the step that are neither parameters nor buffers (untracked)."""
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

    def _cache_held(self, rec: CallRecord) -> int:
        """Bytes of the parameter casts made in the call that the autocast weight cache alone holds now (alive,
        saved by no op): checkpointing the call cannot discard them (:mod:`sacplan.collector.autocast`)."""
        return sum(b for k, b in self.weight_casts.items()
                   if k > rec.alloc_seq_pre and k in self.live_keys and k not in self.packed_at)

    def cache_saved_bytes(self, rec: CallRecord, made: dict[int, int]) -> int:
        """Bytes of the parameter casts made in call ``rec`` (not its outputs ``made``) that an op of the call saved
        for backward: part of its activations, but autocast's weight cache holds them as well until the outermost
        autocast context exits (the end of the forward and loss), so checkpointing the call frees them for its
        backward only, not for the rest of the forward (:mod:`sacplan.collector.autocast`)."""
        return sum(b for k, b in self.weight_casts.items()
                   if k > rec.alloc_seq_pre and k in self.live_keys and k not in made and self.packed_by(rec, k))

    # ------------------------------------------------------------------ hooks ---------------------
    def _fw_pre(self, mod: nn.Module, inputs: Any) -> None:
        if mod in self._deferred:
            return  # starts in _fw_pre_deferred, after the module's own pre-hooks
        self._start_call(mod, inputs)

    def _fw_pre_deferred(self, mod: nn.Module, inputs: Any) -> None:
        self._start_call(mod, inputs)

    def _start_call(self, mod: nn.Module, inputs: Any) -> None:
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
            input_bytes=tensor_bytes_of(inputs, self.spec),
            input_external_bytes=self._external_bytes(inputs),
            input_keys=self._activation_keys(inputs),
            arg_keys=self.read_keys(inputs),
            autocast_cache=autocast_caching(),
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
        made: dict[int, int] = {}
        for st in storages_of(output):
            info = self.storages.get(id(st))
            if info is None:
                continue
            sids.append(info[2])
            if info[2] > rec.alloc_seq_pre and info[1] == ACT:
                new_out += info[0]
                made[info[2]] = info[0]
                rec.out_op = max(rec.out_op, self.sid_creator.get(id(st), -1))
        rec.out_sids = tuple(sids)
        rec.out_new_bytes = new_out
        rec.out_new = tuple(made.items())
        kept = self.act_alloc_total - rec.act_alloc_pre - rec.act_freed_inside
        rec.act_kept = max(0, kept - new_out - self._cache_held(rec))
        rec.cache_held = min(rec.act_kept, self.cache_saved_bytes(rec, made))
        rec.output_bytes = tensor_bytes_of(output, self.spec)
        if kwargs:
            # Tensors passed by keyword are inputs too (the global pre-hook only sees positional ones):
            # count them, and end this call's backward when their gradients are done as well.
            rec.input_bytes = tensor_bytes_of((inputs, kwargs), self.spec)
            rec.input_external_bytes = self._external_bytes((inputs, kwargs))
            rec.input_keys = self._activation_keys((inputs, kwargs))
            rec.arg_keys = self.read_keys((inputs, kwargs))
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
            self.bw_active.append(rec)
            if rec.last_pack < 0:
                self._begin_recompute(rec)  # saved nothing: nothing to recompute
            else:
                self.rc_pending.append(rec)  # begun at the first read of a tensor it saved (note_unpack)

        register_multi_grad_hook(tensors, hook, mode="any")

    def note_unpack(self, ops_before: int) -> None:
        """Autograd reads back a tensor saved after the first ``ops_before`` forward ops (the recorder's unpack
        hook): every call whose backward has begun and which made that op begins its recomputation here.

        ``torch.utils.checkpoint`` (non-reentrant) recomputes a region when its backward first unpacks a tensor
        the region saved, not when the gradient reaches its outputs: the nodes that run before (in-place ops on
        views, additions, views) run with its discarded tensors still absent. So a call's place in
        ``bw_pre_order`` and its rc segment, from which the timeline counts its discarded bytes back, are here.
        """
        if not self.recording or torch._C._current_graph_task_id() == -1:
            return
        # an op of the call saved it (the innermost call open then, or one enclosing it)
        ready = [r for r in self.rc_pending if r.ran_op(ops_before)]
        if ready:
            self.rc_pending = [r for r in self.rc_pending if not r.ran_op(ops_before)]
            for r in ready:
                self._begin_recompute(r)

    def _begin_recompute(self, rec: CallRecord) -> None:
        """``rec``'s backward reaches its saved tensors: it joins ``bw_pre_order`` and its rc segment is recorded.

        Recomputing the call's forward (if checkpointed) happens here. It re-runs the ops up to the last one that
        saved a tensor (early stop) and holds, at its highest, what the forward held at its highest among those
        ops above the call's start; the events after it count the saved tensors (S = post - output) as back, so
        the transient beyond them is max_t live_t - (post_fw - output). The output is not part of S: it is in the
        base only where something still holds it, and a recomputation that re-runs the op making it allocates a
        fresh copy (counted in live_t). An output its own ops saved and still alive here is counted once only
        when the call's backward shows that those saves alone held it (:meth:`_settle_rc_output`).
        """
        if not self.segment_is_empty():
            self.close_segment(Phase.BW)  # the nodes run since the gradient reached the call, before the read
        self.bw_pre_order.append(rec.fqn)
        ran = self.ops[rec.op_start : rec.last_pack] if rec.last_pack > rec.op_start else []
        rec.rc_top = max((o.live for o in ran), default=0)
        extra = max(0, rec.rc_top - (sum(rec.post_fw) - rec.out_new_bytes)) if ran else 0
        rec.rc_out_saved = tuple((k, b) for k, b in rec.out_new if k in self.live_keys and self.packed_by(rec, k))
        rec.rc_segment = len(self.segments)
        self.segments.append(
            Segment(Phase.RC, rec.fqn, rec.call, len(self.fw_post_order), len(self.bw_pre_order), self.total, tuple(self.live),
                    extra=extra, bw_done=len(self.bw_post_order))
        )

    def flush_recomputes(self) -> None:
        """Begin the calls whose backward began and never read a saved tensor (at their backward's end, or the
        whole backward's: ``bw_pre_order`` lists every call whose backward began)."""
        pending, self.rc_pending = self.rc_pending, []
        for r in pending:
            self._begin_recompute(r)

    def _register_bw_post(self, mod: nn.Module, fqn: str, inputs: Any, rec: CallRecord | None) -> None:
        flat, _ = tree_flatten(inputs)
        tensors = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]

        def done(*_: Any) -> None:
            if rec is None or rec.bw_done or not self.recording or rec.event_bw_start < 0:
                return
            if rec.bw_post_fn is not done:
                return  # superseded by a registration that also waits for keyword-argument gradients
            rec.bw_done = True
            if any(r is rec for r in self.rc_pending):  # it never read a tensor it saved
                self.rc_pending = [r for r in self.rc_pending if r is not rec]
                self._begin_recompute(rec)
            self.close_segment(Phase.BW)
            self._settle_rc_output(rec)
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

    def packed_by(self, rec: CallRecord, key: int) -> bool:
        """Whether an op of call ``rec`` saved storage ``key`` for its backward (a forward pack while its ops ran)."""
        return any(rec.ran_op(n) for n in self.packed_at.get(key, ()))

    def _settle_rc_output(self, rec: CallRecord) -> None:
        """Correct the transient of ``rec``'s rc segment once its backward has ended.

        The transient counts the output storages the call made as re-made by a recomputation (its early stop
        re-runs the op making them), on top of the rc event's base. That base holds them as well where the
        unplanned step still has them at the call's backward start because an op of the call saved them (a
        ``relu`` returning its saved output). If they died during the call's backward, those saves were all that
        held them: a checkpointed call has no such saves, so the bytes are absent from its step (full
        recomputation: a fresh copy is made once) or they are the saved output itself (a selective one keeps
        it and does not re-make it). Either way they count once: here, taken off the transient (bytes).
        """
        gone = sum(b for k, b in rec.rc_out_saved if k not in self.live_keys)
        if gone and rec.rc_segment >= 0 and rec.rc_top > 0:
            seg = self.segments[rec.rc_segment]
            seg.extra = max(0, rec.rc_top - (sum(rec.post_fw) - rec.out_new_bytes + gone))

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
        engine.queue_callback(self.flush_recomputes)
        for cb in reversed(self._pending_bw_post):
            engine.queue_callback(cb)
        self._pending_bw_post.clear()

        def reset() -> None:
            self._callback_queued = False

        engine.queue_callback(reset)


def _remove_global_hook(handle: Any) -> None:
    """``handle.remove()`` for a global module hook, its ``with_kwargs`` flag included.

    ``register_module_forward_hook`` files the flag in ``_global_forward_hooks_with_kwargs`` but hands back a
    handle whose ``extra_dict`` lists only ``_global_forward_hooks_always_called`` (torch 2.13), so
    ``remove()`` left ``{id: True}`` behind. That alone keeps ``_has_any_global_hook()`` true, and every
    ``torch.compile``d module then warns about global hooks on each call.
    """
    handle.remove()
    torch.nn.modules.module._global_forward_hooks_with_kwargs.pop(handle.id, None)
