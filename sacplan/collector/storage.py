"""Storage accounting while a step is recorded: the base of :class:`~sacplan.collector.tracker.StepRecorder`.

* Every storage the step makes is registered once, with its category (see :mod:`~sacplan.collector.records`)
  and the target allocator's rounded size (bytes); a ``weakref.finalize`` on the storage takes it off when it
  dies. Gradients and optimizer state are re-labelled when autograd / the optimizer adopt them.
* The live bytes per category are running totals, so every hook and op is O(1) in the model size (PyTorch's
  ``MemTracker`` walks all tracked tensors per snapshot, which is why it slows superlinearly).
* The recorded timeline (what :class:`sacplan.timeline.Timeline` later reads as events) is a list of
  :class:`~sacplan.collector.records.Segment`: each module hook closes the current
  stretch (:meth:`StorageAccounting.close_segment`), whose peak becomes a :class:`~sacplan.stats.MemoryEvent`.
  A segment is placed by the position of the step: the open forward calls, the forwards finished, the
  backwards started and finished. That position is kept here and advanced by the module hooks
  (:class:`~sacplan.collector.module_hooks.ModuleCallHooks`).
* FSDP2 allocates and frees by resizing storages, which no dispatch mode observes:
  :meth:`StorageAccounting.install_resize_hook` follows ``UntypedStorage.resize_`` while the recorder is entered.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from sacplan.collector.records import ACT, OTHER, CallRecord, Segment
from sacplan.devices import DeviceSpec
from sacplan.stats import CATEGORIES, Phase


def storages_of(x: Any) -> list[torch.UntypedStorage]:
    """Untyped storages of every tensor in a pytree (sparse/nested tensors give none).

    A traceable wrapper subclass (a DTensor: one rank's shard behind the global shape) has no memory of its
    own: its inner tensors' storages are returned (a DTensor's local shard), not a storage of the global size.
    """
    flat, _ = tree_flatten(x)
    out = []
    for t in flat:
        if isinstance(t, torch.Tensor) and is_traceable_wrapper_subclass(t):
            attrs, _ctx = t.__tensor_flatten__()
            out += storages_of([getattr(t, a) for a in attrs])
        elif isinstance(t, torch.Tensor) and t.layout == torch.strided:
            try:
                out.append(t.untyped_storage())
            except (RuntimeError, NotImplementedError):
                pass
    return out


def tensor_bytes_of(x: Any, spec: DeviceSpec) -> int:
    """Bytes of the distinct storages of the tensors in ``x``, each rounded as ``spec``'s allocator rounds it."""
    seen: set[int] = set()
    total = 0
    for st in storages_of(x):
        if id(st) not in seen:
            seen.add(id(st))
            total += spec.round_alloc(st.nbytes())
    return total


class StorageAccounting:
    """Live bytes per storage category and the step's timeline of segments (see module docstring).

    A cooperative base class: ``super().__init__()`` goes on to the next class of the recorder
    (``TorchDispatchMode``).

    Args:
        spec: the target device (allocator rounding).
    """

    def __init__(self, spec: DeviceSpec) -> None:
        super().__init__()
        self.spec = spec
        self.live = [0] * len(CATEGORIES)
        self.total = 0
        self.storages: dict[int, list[int]] = {}  # sid -> [nbytes, category, alloc seq, category at alloc]
        #: keys (:meth:`storage_key`) of the tracked storages alive now
        self.live_keys: set[int] = set()
        self.act_alloc_total = 0  # cumulative activation bytes allocated (for per-call kept bytes)
        #: storage key → bytes of the parameter casts the autocast weight cache holds (sacplan.collector.autocast)
        self.weight_casts: dict[int, int] = {}
        self.sid_creator: dict[int, int] = {}  # sid -> global forward op index that created it
        self.alloc_seq = 0
        self.recording = False
        self.in_optimizer = False
        # timeline
        self.segments: list[Segment] = []
        self.seg_peak = 0
        self.seg_cats: tuple[int, ...] = tuple(self.live)
        self.seg_start_total = 0  #: live bytes when the open stretch began
        #: a forward op (outside the optimizer) ran in the open stretch: the first backward op after it ends the
        #: stretch as a forward one (sacplan.collector.tracker)
        self.seg_fw_ops = False
        self.step_peak = 0
        self.step_peak_cats: tuple[int, ...] = tuple(self.live)
        self.step_peak_where: tuple[str, str] = (Phase.FW, "")
        # position on the timeline (advanced by the module hooks)
        self.fw_stack: list[CallRecord] = []
        self.bw_active: list[CallRecord] = []
        self.fw_pre_order: list[str] = []
        self.fw_post_order: list[str] = []
        self.bw_pre_order: list[str] = []
        self.bw_post_order: list[str] = []
        #: storage key → index of the segment in which a forward freed it (outside backward and the optimizer)
        self.freed_in_fw: dict[int, int] = {}
        #: (id, key, total, per-category bytes) of a gradient accumulation whose peak waits on its input's fate
        self.pending_accumulation: tuple[int, int, int, tuple[int, ...]] | None = None

    # ------------------------------------------------------------------ storage accounting --------
    def register(self, t: Any, category: int) -> None:
        """Track the storages of tensors in ``t`` under ``category`` (re-label if already tracked)."""
        for st in storages_of(t):
            self.add_storage(st, category)

    def add_storage(self, st: torch.UntypedStorage, category: int, peak: bool = True) -> int:
        """Track ``st`` under ``category``; returns the bytes it added (0 if it was tracked: then re-labelled).
        ``peak=False``: leave the segment's peak to :meth:`defer_accumulation_peak`."""
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
        self.live_keys.add(self.alloc_seq)
        if category == ACT:
            self.act_alloc_total += nbytes
        weakref.finalize(st, self._free, sid)
        self.live[category] += nbytes
        self.total += nbytes
        if peak and self.total > self.seg_peak:
            self.seg_peak = self.total
            self.seg_cats = tuple(self.live)
        return nbytes

    # ------------------------------------------------------------------ gradient accumulation -----
    def defer_accumulation_peak(self, old: torch.UntypedStorage) -> None:
        """The op just recorded may be autograd's accumulation of a second gradient into a buffered one
        (``buffer = old + new``, its outputs registered with ``peak=False``).

        Outside any dispatch mode the engine adds in place (``old.add_(new)``, no new bytes) when it holds the
        last reference to ``old`` and its storage (``can_accumulate_inplace`` in torch/csrc/autograd/
        input_buffer.cpp); under a dispatch mode (this recorder, fake tensors) every tensor counts as a
        subclass and it adds out of place, so the step seen here holds old, new and the sum at once where the
        real step holds two. Which case it is shows right after: ``old`` dies before the next op exactly when
        the buffer held its last reference. :meth:`settle_accumulation` (at the next op or segment end) counts
        the out-of-place peak only if ``old`` is still alive.
        """
        info = self.storages.get(id(old))
        if info is None:  # untracked input: nothing is known of its lifetime, count the peak now
            self.pending_accumulation = None
            self._raise_peak(self.total, tuple(self.live))
        else:
            self.pending_accumulation = (id(old), info[2], self.total, tuple(self.live))

    def settle_accumulation(self) -> None:
        """See :meth:`defer_accumulation_peak`."""
        pending, self.pending_accumulation = self.pending_accumulation, None
        if pending is not None:
            sid, key, total, cats = pending
            info = self.storages.get(sid)
            if info is not None and info[2] == key:  # still alive: the real engine added out of place too
                self._raise_peak(total, cats)

    def _raise_peak(self, total: int, cats: tuple[int, ...]) -> None:
        if total > self.seg_peak:
            self.seg_peak = total
            self.seg_cats = cats

    def storage_key(self, st: torch.UntypedStorage) -> int | None:
        """A key for a tracked storage that no other storage of this step shares (``None`` if untracked).

        ``id(st)`` identifies a storage only while it lives: CPython hands the address of a dead storage to
        the next object, so op outputs and saved tensors compared by ``id`` after the step matched storages
        that merely reused a dead one's address, and ``saved_by_autograd`` / ``is_output`` varied from run to
        run. The allocation sequence number is unique over the recorder's life.
        """
        info = self.storages.get(id(st))
        return None if info is None else info[2]

    def read_keys(self, tensors: Any) -> tuple[int, ...]:
        """Keys of the storages of the tensors in a pytree: tracked ones by :meth:`storage_key`, the step's
        untracked ones (its example inputs, parameters) by ``-id`` (they outlive the forward, so the id is
        theirs for the whole step)."""
        keys = []
        for st in storages_of(tensors):
            k = self.storage_key(st)
            keys.append(-id(st) if k is None else k)
        return tuple(dict.fromkeys(keys))

    def _free(self, sid: int) -> None:
        info = self.storages.pop(sid, None)
        if info is not None:
            self.live_keys.discard(info[2])
            if self.recording and not self.in_optimizer and torch._C._current_graph_task_id() == -1:
                self.freed_in_fw[info[2]] = len(self.segments)
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

    def held_by_checkpoint(self, rec: CallRecord) -> int:
        """Bytes a non-reentrant checkpoint of ``rec`` would keep besides saved tensors: its activation inputs
        that a forward freed before the call's backward began (nothing saved them). ``torch.utils.checkpoint``
        holds a region's inputs until the region's backward to re-run it; inputs something saves live that long
        anyway. A forward may run after another call's backward (a pipeline schedule's later microbatches,
        gradient accumulation): what counts is this call's backward (its segment, ``event_bw_start``)."""
        bw = rec.event_bw_start
        return sum(b for k, b in rec.input_keys if k in self.freed_in_fw and (bw < 0 or self.freed_in_fw[k] < bw))

    def snapshot(self) -> tuple[int, ...]:
        return tuple(self.live)

    # ------------------------------------------------------------------ timeline ------------------
    def _phase(self) -> str:
        if self.in_optimizer:
            return Phase.OTHER
        return Phase.BW if torch._C._current_graph_task_id() != -1 else Phase.FW

    def close_segment(self, phase: str | None = None) -> None:
        """End the current stretch of the timeline and start a new one at the current live bytes."""
        self.settle_accumulation()
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
        self.seg_start_total = self.total
        self.seg_fw_ops = False

    def segment_is_empty(self) -> bool:
        """Whether the open stretch has seen no change of the live bytes (nothing allocated, freed or pending)."""
        return self.seg_peak == self.seg_start_total == self.total and self.pending_accumulation is None

    # ------------------------------------------------------------------ storage resizes -----------
    def install_resize_hook(self, undo: contextlib.ExitStack) -> None:
        """See ``UntypedStorage.resize_``: FSDP2 allocates and frees unsharded parameters and its all-gather
        buffers by resizing storages, which no dispatch mode observes. ``undo`` puts the original back."""
        orig = torch.UntypedStorage.resize_
        rec = self

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = orig(st, size)
            info = rec.storages.get(id(st))
            if info is None:
                if st.nbytes() > 0:
                    rec.add_storage(st, OTHER)
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
        undo.callback(self._restore_resize)

    def _restore_resize(self) -> None:
        if self._resize_was_own:
            torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        else:  # inherited from torch._C.StorageBase: assigning it back would shadow the base class's
            del torch.UntypedStorage.resize_
