"""One dispatch mode that records memory, runtime and per-op SAC facts of a training step.

:class:`StepRecorder` is a ``TorchDispatchMode`` plus global module hooks, in three layers:

* :mod:`~sacplan.collector.storage` (storage accounting and the recorded segments): every *new* output storage is
  registered with the category of the phase it was made in (forward → activation, backward → temp, optimizer
  step → temp; gradients and optimizer state are re-labelled when autograd / the optimizer adopt them) and the
  target allocator's rounded size, and the live bytes per category are running totals;
* :mod:`~sacplan.collector.module_hooks` (module hooks): every forward pre/post and backward pre/post closes a
  *segment* of the timeline whose peak becomes a :class:`~sacplan.stats.MemoryEvent`, and records the call;
* this module (op recording): per aten op, the dispatch mode registers its outputs, estimates its time on the
  target (:class:`~sacplan.collector.runtime.RuntimeModel`) and adds it to the active modules, and in forward
  appends an op record (output bytes, view / in-place / random flags, FLOPs) to one global list; each module
  call remembers its contiguous slice of it. The autograd pack hook marks the tensors autograd saves.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch._prims_common as _prims_common
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from sacplan.collector.autocast import is_weight_cast
from sacplan.collector.inplaceviews import InplaceViewBackwards
from sacplan.collector.linearbias import LinearBiasMode, is_linear_bias_add
from sacplan.collector.module_hooks import ModuleCallHooks
from sacplan.collector.records import ACT, TEMP, OpRecord, Packed
from sacplan.collector.runtime import RuntimeModel, op_flops
from sacplan.collector.storage import storages_of
from sacplan.collector.workspace import WORKSPACE_OPS, workspace_bytes
from sacplan.devices import DeviceSpec
from sacplan.opnames import draws_random_numbers, is_attention_op
from sacplan.stats import Phase

try:  # torch >= 2.4
    from torch.utils.checkpoint import SAC_IGNORED_OPS as _SAC_IGNORED
except ImportError:  # pragma: no cover - older torch
    _SAC_IGNORED = {torch.ops.aten.detach.default}

aten = torch.ops.aten
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
def is_metadata_query(func: Any) -> bool:
    """Whether ``func`` is a metadata query (``prim.device`` and the other ``prim`` ops), not a kernel.

    A fake tensor answers them through the dispatcher (``prim.device``, e.g. inside ``linear`` right after its bias
    add); on real tensors they never reach a dispatch mode. They allocate nothing and run no kernel, so they do not
    mark the "next op" a deferred peak waits for (``settle_accumulation``: settling at them counted peaks the real
    step never has), and they run inside an op's autograd, so they do not settle pending in-place view backwards.
    """
    return func.namespace == "prim"


_VIEW_CACHE: dict[Any, tuple[bool, bool]] = {}
#: ``TensorImpl::is_non_overlapping_and_dense`` from Python (renamed ``..._or_false`` in newer torch)
_DENSE = getattr(_prims_common, "is_non_overlapping_and_dense_or_false", None) or _prims_common.is_non_overlapping_and_dense


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


class StepRecorder(ModuleCallHooks, TorchDispatchMode):
    """Records one training step (see module docstring). Use as a context manager around the step.

    Args:
        model: the model (its module names become fqns; the root is ``""``).
        spec: the target device (allocator rounding, roofline figures).
        runtime: the runtime model.
    """

    def __init__(self, model: nn.Module, spec: DeviceSpec, runtime: RuntimeModel) -> None:
        super().__init__(model, spec)
        self.runtime = runtime
        #: set by the attention mode when the next attention kernel was called with dropout
        self.next_sdpa_random = False
        self.failed_op: tuple[Any, BaseException] | None = None
        # forward ops
        self.ops: list[OpRecord] = []
        #: per storage key, ``len(self.ops)`` at each forward pack of it (the op that saved it is the one before)
        self.packed_at: dict[int, list[int]] = {}
        # totals
        self.fw_ms = self.bw_ms = self.opt_ms = 0.0
        self.fw_flops = self.bw_flops = 0
        self._undo: contextlib.ExitStack | None = None
        #: the bias of the ``F.linear`` call running (see :mod:`~sacplan.collector.linearbias`)
        self.linear_bias = LinearBiasMode()
        #: the real step's ``as_strided`` backward of in-place ops on views, which the fake step replays as aliases
        self.inplace_views = InplaceViewBackwards()

    # ------------------------------------------------------------------ dispatch ------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not is_metadata_query(func):
            self.settle_accumulation()
            if func not in IGNORED_OPS:
                self.inplace_views.settle(args, kwargs)
        try:
            out = func(*args, **kwargs)
        except Exception as e:
            self.failed_op = (func, e)  # the op a failing step died in (collect names it)
            raise
        if func in IGNORED_OPS:
            return out
        is_view, is_inplace = op_kind(func)
        if is_inplace and args and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            self.inplace_views.note(args, kwargs)
        reads: tuple[int, ...] = ()
        writes: tuple[int, ...] = ()
        if self.recording and not self.in_optimizer and torch._C._current_graph_task_id() == -1:
            reads = self.read_keys((args, kwargs))  # before this op registers its outputs
            writes = self.read_keys(out) if is_inplace else ()
        in_bw = torch._C._current_graph_task_id() != -1
        if in_bw and self.seg_fw_ops:
            # The backward's first op after forward ops outside the modules' hooks (a train_step's loss, which the
            # built-in step closes itself): the stretch before it is forward. Under autocast it ends inside the
            # context, whose weight cache still holds the parameter casts (sacplan.collector.autocast): the
            # memory model keeps them at forward events only.
            self.close_segment(Phase.FW)
        elif self.recording and not in_bw and not self.in_optimizer:
            self.seg_fw_ops = True
        category = TEMP if (in_bw or self.in_optimizer) else ACT
        accumulated = self._in_place_on_real(func, args, kwargs, out, in_bw)
        out_sids, out_new, fresh = self._register_outputs(out, category, accumulated)
        new_bytes = sum(out_new)
        if accumulated is not None:
            self.defer_accumulation_peak(accumulated)
        out_keys = tuple(self.storages[sid][2] for sid in out_sids)
        if fresh and category == ACT and self.fw_stack and self.fw_stack[-1].autocast_cache \
                and is_weight_cast(func, args, kwargs):
            self.weight_casts[out_keys[0]] = new_bytes
        ws = self._workspace(func, args, kwargs, out)
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
            is_random, parent = self._random_and_parent(func, args, kwargs, is_inplace, out_sids)
            self.ops.append(OpRecord(func, new_bytes, out_keys, ms, flops, is_view, is_inplace, is_random, parent, tuple(out_new),
                                     self.total + ws, reads, writes))
            for rec in self.fw_stack:
                rec.fw_ms += ms
                rec.fw_flops += flops
        return out

    def _register_outputs(self, out: Any, category: int, accumulated: Any) -> tuple[list[int], list[int], int]:
        """The ids of ``out``'s storages, per storage the bytes registered now (0: already tracked), and how many
        were not tracked before (registered now, even with 0 bytes)."""
        out_sids: list[int] = []
        out_new: list[int] = []
        fresh = 0
        for st in storages_of(out):
            sid = id(st)
            out_sids.append(sid)
            if sid not in self.storages:
                fresh += 1
                out_new.append(self.add_storage(st, category, peak=accumulated is None))
            else:
                out_new.append(0)
        return out_sids, out_new, fresh

    def _workspace(self, func: Any, args: tuple, kwargs: dict, out: Any) -> int:
        """The op's transient workspace bytes (:func:`workspace_bytes`), raising the segment's peak where it tops it."""
        ws = workspace_bytes(self.spec, func, args, kwargs, out) if func in WORKSPACE_OPS else 0
        if ws and self.total + ws > self.seg_peak:
            self.seg_peak = self.total + ws
            cats = list(self.live)
            cats[TEMP] += ws
            self.seg_cats = tuple(cats)
        return ws

    def _in_place_on_real(self, func: Any, args: tuple, kwargs: dict, out: Any, in_bw: bool) -> torch.UntypedStorage | None:
        """The storage of the input an out-of-place op seen here writes in place on plain tensors, if the real step
        may (its peak is then deferred: ``defer_accumulation_peak``): autograd's gradient accumulation in backward,
        ``F.linear``'s bias add in forward (:mod:`~sacplan.collector.linearbias`)."""
        if self.in_optimizer:
            return None
        if in_bw:
            return accumulation_input(func, args, kwargs, out)
        mm_out = is_linear_bias_add(func, args, kwargs, self.linear_bias.bias)
        sts = storages_of(mm_out) if mm_out is not None else []
        return sts[0] if sts else None

    def _random_and_parent(self, func: Any, args: tuple, kwargs: dict, is_inplace: bool, out_sids: list[int]) -> tuple[bool, int | None]:
        """Whether the next forward op draws random numbers, and for an in-place op the index of the op that made
        the storage it writes; records it as the maker of its new storages."""
        g = len(self.ops)
        # the rule apply's policy keeps (sacplan.opnames): attention kernels carry the seeded tag but draw only
        # with dropout (or when the routed SDPA call above them did)
        is_random = draws_random_numbers(func, args, kwargs)
        if is_attention_op(func):
            is_random = is_random or self.next_sdpa_random
            self.next_sdpa_random = False
        parent = None
        if is_inplace:
            parent = next((self.sid_creator[sid] for sid in out_sids if sid in self.sid_creator), None)
        for sid in out_sids:
            self.sid_creator.setdefault(sid, g)
        return is_random, parent

    # ------------------------------------------------------------------ autograd pack hook --------
    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.recording and torch._C._current_graph_task_id() == -1:
            try:
                key = self.storage_key(t.untyped_storage())
            except (RuntimeError, NotImplementedError):
                key = None
            n = len(self.ops)
            if key is not None:
                self.packed_at.setdefault(key, []).append(n)
            for rec in self.fw_stack:
                rec.last_pack = n
            return Packed(t, n)
        return t

    def _unpack(self, x: Any) -> torch.Tensor:
        if isinstance(x, Packed):
            self.note_unpack(x.ops_before)
            return x.tensor
        return x

    # ------------------------------------------------------------------ context -------------------
    def __enter__(self) -> "StepRecorder":
        # Everything global this installs is undone by ``self._undo`` (last in, first out), also when entering
        # fails halfway: after the step every global hook dict, ``UntypedStorage.resize_`` and the saved-tensor
        # hooks stack are as they were (tests/collector/test_global_state.py).
        with contextlib.ExitStack() as undo:
            self.install_module_hooks(undo)
            undo.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack))
            undo.enter_context(self.linear_bias)
            self.install_resize_hook(undo)
            out = super().__enter__()
            self._undo = undo.pop_all()
        return out

    def __exit__(self, *exc: Any) -> None:
        undo, self._undo = self._undo, None
        try:
            super().__exit__(*exc)
        finally:
            if undo is not None:
                undo.close()


def accumulation_input(func: Any, args: tuple, kwargs: dict, out: Any) -> torch.UntypedStorage | None:
    """The storage of ``old`` if this backward op can be the engine's gradient accumulation ``old + new`` that
    the real step runs in place (``old.add_(new)``; see ``StorageAccounting.defer_accumulation_peak``), else
    ``None``. Mirrors the engine's ``can_accumulate_inplace``: grad mode off, a plain ``add`` of two strided
    tensors of ``old``'s shape and dtype, ``old`` non-overlapping and dense and not a view (whose storage its
    base shares); whether the engine held the last reference is decided by ``old``'s lifetime after the op."""
    if func is not aten.add.Tensor or torch.is_grad_enabled() or kwargs.get("alpha", 1) != 1 or len(args) != 2:
        return None
    old, new = args
    if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and isinstance(out, torch.Tensor)):
        return None
    if old.layout != torch.strided or new.layout != torch.strided or old.shape != new.shape or old.shape != out.shape:
        return None
    if old.dtype != new.dtype or old.dtype != out.dtype or not _DENSE(old):
        return None
    if old._is_view():
        # a view holds its base's storage too (storage use count 2): the engine adds out of place. A Linear
        # weight's gradient is one (``mm(...).t()``), so a weight used twice (tied) accumulates out of place.
        return None
    try:
        st = old.untyped_storage()
        if st._cdata == new.untyped_storage()._cdata:
            return None  # the same gradient twice (``z + z``'s backward): the engine holds it twice, out of place
        return st
    except (RuntimeError, NotImplementedError):
        return None
