"""What :class:`~sacplan.collector.tracker.StepRecorder` records: storage categories, forward ops, module calls
and timeline segments.

Plain data shared by the recorder's parts (:mod:`~sacplan.collector.storage`, :mod:`~sacplan.collector.module_hooks`,
:mod:`~sacplan.collector.tracker`) and read by :mod:`~sacplan.collector.assemble`, which turns them into
:class:`~sacplan.stats.ModelStats`. Byte figures are the target allocator's rounded sizes; times are ms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sacplan.stats import CATEGORIES

#: index of each storage category (:data:`sacplan.stats.CATEGORIES`) in the recorder's per-category counters
CAT = {name: i for i, name in enumerate(CATEGORIES)}
PARAM, BUFFER, GRAD, OPT, INPUT, ACT, TEMP, OTHER = (CAT[c] for c in CATEGORIES)


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
    #: storage keys of the op's tensor arguments as they were before it ran (untracked storages by ``-id``;
    #: see ``StorageAccounting.read_keys``), and for an in-place op the keys of the storages it writes, likewise
    in_sids: tuple[int, ...] = ()
    writes: tuple[int, ...] = ()


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
    #: an autocast context with its weight cache was active when the call began (:mod:`sacplan.collector.autocast`)
    autocast_cache: bool = False
    #: bytes of the parameter casts made in the call that an op of it saved and autocast's weight cache also holds
    #: until autocast exits (:meth:`~sacplan.collector.module_hooks.ModuleCallHooks.cache_saved_bytes`)
    cache_held: int = 0
    out_sids: tuple[int, ...] = ()  #: storage keys of the output (see ``StepRecorder.storage_key``)
    out_new_bytes: int = 0
    #: ``(storage key, bytes)`` of the distinct output storages the call made (``out_new_bytes`` counts them)
    out_new: tuple[tuple[int, int], ...] = ()
    #: index in the recorder's segments of the call's rc segment (-1: its backward has not begun)
    rc_segment: int = -1
    #: highest live bytes among the ops a recomputation of the call re-runs (0: it re-runs none)
    rc_top: int = 0
    #: ``out_new`` entries alive at the call's backward start that an op of the call saved for its backward
    rc_out_saved: tuple[tuple[int, int], ...] = ()
    #: global index of the last forward op that made a new output storage (-1: none)
    out_op: int = -1
    input_bytes: int = 0
    #: bytes of the inputs' storages the step did not allocate: its own example inputs and untracked tensors
    input_external_bytes: int = 0
    #: ``(storage key, bytes)`` of the tracked activation storages among the call's tensor inputs
    input_keys: tuple[tuple[int, int], ...] = ()
    #: keys of every storage among the call's tensor arguments (``StorageAccounting.read_keys``)
    arg_keys: tuple[int, ...] = ()
    output_bytes: int = 0
    fw_ms: float = 0.0
    bw_ms: float = 0.0
    fw_flops: int = 0
    bw_flops: int = 0
    bw_done: bool = False
    bw_post_fn: Any = None  # the live backward-post callback (a later one supersedes it)
    #: parameters whose accumulated gradients end this call's backward (no input of it needs a gradient)
    end_params: tuple = ()

    def ran_op(self, n: int) -> bool:
        """Whether the recorder's op count ``n`` (taken as an op of the forward ran, e.g. at a pack) falls inside
        this call's forward: an op of it, or of a call it encloses."""
        return self.op_start < n <= self.op_end


@dataclass(frozen=True, eq=False)
class Packed:
    """What the recorder's autograd pack hook hands autograd for a tensor saved during the recorded forward: the
    tensor and ``ops_before``, the number of forward ops recorded when it was saved (the op that saved it is the
    one before), so that reading it back in backward (the unpack hook) says which module calls' saved tensors
    are being read (:meth:`~sacplan.collector.module_hooks.ModuleCallHooks.note_unpack`)."""

    tensor: Any
    ops_before: int


@dataclass
class Segment:
    """One stretch of the step's timeline between two hooks: its highest live bytes and, at that moment, the
    bytes per category (:mod:`~sacplan.collector.assemble` merges segments into
    :class:`~sacplan.stats.MemoryEvent` entries)."""

    phase: str
    module: str
    call: int
    fw_done: int
    bw_started: int
    peak: int
    cats: tuple[int, ...]
    extra: int = 0
    bw_done: int = 0  #: entries of ``bw_post_order`` completed before the stretch
