"""Frozen statistics produced by :func:`sacplan.collect` and read by every later stage.

Units: sizes are ``int`` bytes as the *target* allocator holds them (rounded to its block size);
times are ``float`` milliseconds on the target device; FLOPs are ``int``.

The flow is one-way: ``collect`` builds :class:`ModelStats`; :class:`sacplan.tree.ModuleTree` wraps it;
the solver reads the tree. Nothing here imports from a later stage.

Memory timeline model
---------------------
During the collected (no checkpointing) step, the live bytes are recorded between every pair of module
hook events. Each :class:`MemoryEvent` is the peak of one such stretch and says how far the step had got:

* ``fw_done``: how many entries of :attr:`ModelStats.fw_post_order` (module *calls* whose forward had
  finished) lie before the stretch;
* ``bw_started``: how many entries of :attr:`ModelStats.bw_pre_order` (module calls whose backward had
  begun) lie before the stretch.

That is all the solver needs to know which checkpointed modules' discarded activations are absent at
that moment (see :mod:`sacplan.solver`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable, Mapping, Sequence

from sacplan.devices import DeviceSpec
from sacplan import fqns

#: Memory categories tracked per allocation.
class Phase(str, Enum):
    """Where in the step a :class:`MemoryEvent` sits (a ``str``: events saved as ``"fw"`` etc. load unchanged).

    ``FW`` forward; ``BW`` backward; ``RC`` a module's backward start (its first read of a tensor it saved, where
    non-reentrant checkpointing recomputes), where recomputing it would add its transient if it is checkpointed;
    ``OTHER`` loss and optimizer step (no checkpointing decision changes them).
    """

    FW = "fw"
    BW = "bw"
    RC = "rc"
    OTHER = "other"

    def __str__(self) -> str:
        return self.value


CATEGORIES = ("param", "buffer", "grad", "optimizer", "input", "activation", "temp", "other")
#: Snapshot names recorded per module call.
SNAPSHOTS = ("pre_fw", "peak_fw", "post_fw", "pre_bw", "peak_bw", "post_bw")


def _tuple(x: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(x)


@dataclass(frozen=True)
class MemSnapshot:
    """Live bytes per category at one instant (``total`` is their sum)."""

    param: int = 0
    buffer: int = 0
    grad: int = 0
    optimizer: int = 0
    input: int = 0
    activation: int = 0
    temp: int = 0
    other: int = 0

    @property
    def total(self) -> int:
        return (
            self.param + self.buffer + self.grad + self.optimizer + self.input + self.activation + self.temp + self.other
        )

    @property
    def state(self) -> int:
        """Parameters + gradients + optimizer state: the part FSDP shards."""
        return self.param + self.grad + self.optimizer

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, int]) -> "MemSnapshot":
        return cls(**{k: int(v) for k, v in d.items()})


@dataclass(frozen=True)
class OpStat:
    """One aten op run inside a module's forward (SAC-ignored ops such as ``detach`` excluded).

    Attributes:
        index: position among the recorded ops of this module call (0-based).
        name: overload name, e.g. ``"aten.mm.default"``.
        occurrence: how many earlier ops with the same ``name`` this module call ran; ``(name, occurrence)``
            is how a selective-checkpoint policy recognises the op at apply time.
        out_bytes: bytes of *new* output storages (allocator-rounded); 0 for views and in-place ops.
        runtime_ms: estimated time on the target device.
        flops: floating-point operations (as ``torch.utils.flop_counter`` counts them; 0 if it does not).
        is_view: the op only creates views (always recomputed, free).
        is_random: the op draws random numbers (random ops are all saved or all recomputed together).
        inplace_of: for an in-place op, the index of the op whose output it modifies (its group head).
        saved_by_autograd: an output of this op is packed by autograd for backward.
        is_output: an output of this op is (part of) the module's output.
        save_cost_bytes: bytes that saving this op under SAC holds beyond the module's output:
            ``out_bytes`` unless the output is the module output itself (then 0).
        below_peak_bytes: how far the live bytes stood below this call's forward peak just after the op ran
            (its outputs and kernel scratch allocated); ``None`` when not recorded (stats from older versions).
            A selective recomputation holds every saved tensor from its start, so where saved tensors made
            *after* an op outweigh this headroom, recomputation peaks above the forward
            (:func:`~sacplan.tradeoff.recompute_surge`).
        tied_to: indices of the ops whose save decision this op must share because it reads a storage that an
            in-place op overwrites later in the forward (``-1``: it must always be saved); see
            :mod:`sacplan.collector.mutations`. Empty for stats from older versions.
        output_kept_outside: this op makes (part of) the module's output, which only later modules' backwards
            read (they saved it), none inside the module: the unplanned step frees it once those backwards are
            done, before this module's backward; a selective cache holding it would keep it through this module's
            recomputation and backward. Such an op is never saved (:mod:`sacplan.opgroups`). False in stats from
            older versions.
        cached_cast: the op is a parameter's cast that autocast's weight cache keeps until autocast exits
            (:mod:`sacplan.collector.autocast`). Never saved (:mod:`sacplan.opgroups`): the memory model frees a
            checkpointed call's saved casts at backward events only (:attr:`ModuleStats.cache_held`), which a save
            list keeping one would count twice. False in stats from older versions and without autocast.
    """

    index: int
    name: str
    occurrence: int
    out_bytes: int
    runtime_ms: float
    flops: int
    is_view: bool = False
    is_random: bool = False
    inplace_of: int | None = None
    saved_by_autograd: bool = False
    is_output: bool = False
    save_cost_bytes: int = 0
    below_peak_bytes: int | None = None
    tied_to: tuple[int, ...] = ()
    output_kept_outside: bool = False
    cached_cast: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "OpStat":
        kw = dict(d)
        kw["tied_to"] = tuple(int(t) for t in kw.get("tied_to", ()))  # a JSON list
        return cls(**kw)


@dataclass(frozen=True)
class TradeOff:
    """Recompute cost of a module as a function of the activation bytes it discards.

    With discard fraction ``r = discarded / max_discard_bytes`` in ``[0, 1]`` and recompute fraction
    ``q = recompute_ms / full_recompute_ms``, a checkpointed module costs ``q(r) = max_s(slopes[s] * r +
    intercepts[s])``: a convex piecewise-linear *upper bound* of what the op-level selection achieves, so
    a plan never costs more than predicted. ``points`` are the achievable (r, q) vertices of the greedy
    order (op groups taken in decreasing bytes-per-ms) that the lines bound.

    Attributes:
        max_discard_bytes: activation bytes full checkpointing of one call frees (``A``), bytes.
        full_recompute_ms: recompute time of full checkpointing of one call (``R``), ms.
        points: greedy vertices ``(r, q)``, r ascending, first r = 0.
        slopes, intercepts: the lines (dimensionless, in (r, q) units).
        full_recompute_flops: FLOPs recomputed by full checkpointing of one call.
    """

    max_discard_bytes: int
    full_recompute_ms: float
    points: tuple[tuple[float, float], ...]
    slopes: tuple[float, ...]
    intercepts: tuple[float, ...]
    full_recompute_flops: int = 0

    def recompute_fraction(self, r: float) -> float:
        """Upper-bound recompute fraction at discard fraction ``r`` (0 when ``r`` is 0 and not checkpointed)."""
        return max(s * r + b for s, b in zip(self.slopes, self.intercepts))

    def recompute_ms(self, discard_bytes: float) -> float:
        """Upper-bound recompute ms to discard ``discard_bytes`` of one call."""
        if self.max_discard_bytes <= 0:
            return 0.0
        r = min(1.0, max(0.0, discard_bytes / self.max_discard_bytes))
        return self.full_recompute_ms * self.recompute_fraction(r)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["points"] = [list(p) for p in self.points]
        d["slopes"] = list(self.slopes)
        d["intercepts"] = list(self.intercepts)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TradeOff":
        return cls(
            max_discard_bytes=int(d["max_discard_bytes"]),
            full_recompute_ms=float(d["full_recompute_ms"]),
            points=tuple((float(a), float(b)) for a, b in d["points"]),
            slopes=tuple(float(x) for x in d["slopes"]),
            intercepts=tuple(float(x) for x in d["intercepts"]),
            full_recompute_flops=int(d.get("full_recompute_flops", 0)),
        )


@dataclass(frozen=True)
class ModuleStats:
    """Statistics of one module (fully qualified name ``fqn``; the root is ``""``).

    Per-call quantities are tuples with one entry per call of the module in the step; the scalar fields
    are totals over calls unless noted.

    Attributes:
        fqn, module_type, parent, depth, is_leaf: place in the module tree (``parent`` is None for the root).
        calls: how many times the forward ran in one step.
        param_bytes: parameters of the subtree (each shared parameter counted once).
        buffer_bytes: buffers of the subtree.
        grad_bytes: gradients of the subtree's parameters.
        optimizer_bytes: optimizer state of the subtree's parameters.
        input_bytes, output_bytes: tensor bytes of the first call's inputs and outputs.
        act_bytes: activation bytes kept alive by the forward of each call beyond its output
            (what full checkpointing frees), per call.
        act_grad_bytes: per call, peak backward bytes above the live bytes at backward start.
        fw_transient_bytes: per call, the forward peak above the bytes live after the forward
            (temporaries that recomputation allocates again), bytes.
        held_input_bytes: per call, bytes of the call's input activations that nothing saves for backward
            (the step frees them before backward starts): checkpointing the module keeps them from its
            forward to its backward, because ``torch.utils.checkpoint`` holds a region's inputs to re-run it.
            Empty: none (stats from older versions).
        cache_held: per call, bytes of the parameter casts the call saved for backward that autocast's weight cache
            holds as well until autocast exits (the end of the forward and loss; :mod:`sacplan.collector.autocast`):
            part of ``act_bytes``, but checkpointing the call frees them only for the backward, not for the forward
            events after the call. Empty: none (no autocast, or stats from older versions).
        input_external_bytes: bytes of the first call's inputs (part of ``input_bytes``) that the step did not
            allocate: the example inputs, and tensors made before the step that are neither parameters nor
            buffers. 0 in stats from older versions.
        fw_ms, bw_ms: estimated forward / backward time per call on the target.
        fw_flops, bw_flops: FLOPs per call.
        snapshots: per call, ``{name: MemSnapshot}`` for the names in :data:`SNAPSHOTS`.
        ops: the first call's forward ops (see :class:`OpStat`).
        recompute_stop: recomputation of this module under non-reentrant checkpoint (early stop on)
            runs ops ``0 .. recompute_stop - 1`` only (0: none, its forward packed nothing, so nothing is ever
            re-run); ``None``: no early stop, every op may be re-run (stats that do not say). The one encoding of
            "no stop" (:func:`sacplan.opgroups.stop_index` reads it).
        tradeoff: the recompute trade-off of one call; ``None`` when nothing can be discarded.
    """

    fqn: str
    module_type: str
    parent: str | None
    depth: int
    is_leaf: bool
    calls: int
    param_bytes: int
    buffer_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    input_bytes: int
    output_bytes: int
    act_bytes: tuple[int, ...]
    act_grad_bytes: tuple[int, ...]
    fw_transient_bytes: tuple[int, ...]
    fw_ms: tuple[float, ...]
    bw_ms: tuple[float, ...]
    fw_flops: tuple[int, ...]
    bw_flops: tuple[int, ...]
    snapshots: tuple[Mapping[str, MemSnapshot], ...]
    ops: tuple[OpStat, ...] = ()
    recompute_stop: int | None = None
    tradeoff: TradeOff | None = None
    held_input_bytes: tuple[int, ...] = ()
    input_external_bytes: int = 0
    cache_held: tuple[int, ...] = ()

    @property
    def draws_random(self) -> bool:
        """Whether a call's forward draws random numbers (an op with :attr:`OpStat.is_random`: dropout, attention
        with dropout, ``rand*``), so that recomputing it must replay the forward's random state. True when no ops
        were recorded (unknown: assume it does).

        A checkpointed region that draws none needs no RNG state: ``apply`` checkpoints it with
        ``preserve_rng_state=False`` and the memory model keeps no stashed state for it
        (:func:`~sacplan.devices.checkpoint_state_bytes`).
        """
        return not self.ops or any(o.is_random for o in self.ops)

    @property
    def total_act_bytes(self) -> int:
        return sum(self.act_bytes)

    @property
    def total_fw_ms(self) -> float:
        return sum(self.fw_ms)

    @property
    def total_bw_ms(self) -> float:
        return sum(self.bw_ms)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "snapshots":
                v = [{k: s.to_dict() for k, s in call.items()} for call in v]
            elif f.name == "ops":
                v = [o.to_dict() for o in v]
            elif f.name == "tradeoff":
                v = None if v is None else v.to_dict()
            elif isinstance(v, tuple):
                v = list(v)
            d[f.name] = v
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModuleStats":
        kw = dict(d)
        kw["snapshots"] = tuple({k: MemSnapshot.from_dict(s) for k, s in call.items()} for call in d["snapshots"])
        kw["ops"] = tuple(OpStat.from_dict(o) for o in d.get("ops", ()))
        kw["tradeoff"] = None if d.get("tradeoff") is None else TradeOff.from_dict(d["tradeoff"])
        for name in ("act_bytes", "act_grad_bytes", "fw_transient_bytes", "fw_flops", "bw_flops"):
            kw[name] = tuple(int(x) for x in d[name])
        kw["held_input_bytes"] = tuple(int(x) for x in d.get("held_input_bytes", ()))
        kw["cache_held"] = tuple(int(x) for x in d.get("cache_held", ()))
        for name in ("fw_ms", "bw_ms"):
            kw[name] = tuple(float(x) for x in d[name])
        return cls(**kw)


@dataclass(frozen=True)
class MemoryEvent:
    """The peak of live bytes in one stretch of the step between two module hook events.

    Attributes:
        phase: ``"fw"`` (forward), ``"bw"`` (backward), ``"rc"`` (a module's backward start, where
            recomputation would add ``extra_bytes`` if that module is checkpointed), or ``"other"``
            (loss, optimizer step: no checkpointing decision changes it).
        module: fqn of the innermost module running (``""`` at top level).
        call: which call of ``module``.
        fw_done: entries of ``fw_post_order`` completed before the stretch.
        bw_started: entries of ``bw_pre_order`` begun before the stretch (0 in forward).
        peak_bytes: peak live bytes of the stretch (all categories).
        state_bytes: parameters + gradients + optimizer state live at that peak (FSDP shards these).
        extra_bytes: for ``"rc"`` events, the recompute transient of ``module``'s forward.
        bw_done: entries of ``bw_post_order`` completed before the stretch (``-1``: not recorded, stats from
            older versions); with ``bw_started`` it says which calls are inside their backward
            (:meth:`ModelStats.backward_active`).
    """

    phase: str
    module: str
    call: int
    fw_done: int
    bw_started: int
    peak_bytes: int
    state_bytes: int
    extra_bytes: int = 0
    bw_done: int = -1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "MemoryEvent":
        return cls(**dict(d))


@dataclass(frozen=True)
class ModelStats:
    """Everything one collected training step says about a model on a target device.

    Attributes:
        device: the target :class:`DeviceSpec`.
        model_name: a label (class name or preset).
        dtype: parameter dtype name, e.g. ``"torch.bfloat16"``.
        world_size: ranks the sizes are per (1 unless collected for FSDP/DDP).
        modules: per-module stats in forward pre-order of first calls.
        fw_pre_order, fw_post_order, bw_pre_order, bw_post_order: module calls as fqns in the order their
            forward starts / forward ends / backward starts / backward ends (a module called twice appears twice).
            A call's backward "starts" where ``torch.utils.checkpoint`` would recompute it: when its backward first
            reads back a tensor one of its ops saved (not when the gradient reaches its outputs: the nodes before
            that read nothing of it); a call that saved nothing starts when the gradient reaches its outputs.
        events: the memory timeline (see module docstring).
        peak_bytes: whole-step peak live bytes; ``peak_phase`` / ``peak_module`` say where it occurs.
        peak_snapshot: live bytes per category at that peak.
        param_bytes, grad_bytes, optimizer_bytes: whole-model totals.
        fw_ms, bw_ms, optimizer_ms: estimated time of the forward, backward, optimizer step.
        fw_flops, bw_flops: FLOPs of forward and backward.
        fingerprint: a hash of module fqns, parameter shapes and input shapes (see :mod:`sacplan.plan`).
        input_shapes: shapes of the example inputs' tensors.
        meta: free-form provenance (torch version, host, collection seconds...).
    """

    device: DeviceSpec
    model_name: str
    dtype: str
    world_size: int
    modules: tuple[ModuleStats, ...]
    fw_pre_order: tuple[str, ...]
    fw_post_order: tuple[str, ...]
    bw_pre_order: tuple[str, ...]
    bw_post_order: tuple[str, ...]
    events: tuple[MemoryEvent, ...]
    peak_bytes: int
    peak_phase: str
    peak_module: str
    peak_snapshot: MemSnapshot
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    fw_ms: float
    bw_ms: float
    optimizer_ms: float
    fw_flops: int
    bw_flops: int
    fingerprint: str
    input_shapes: tuple[tuple[int, ...], ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def step_ms(self) -> float:
        """Estimated forward + backward + optimizer time, ms."""
        return self.fw_ms + self.bw_ms + self.optimizer_ms

    def backward_active(self) -> list[tuple[int, ...]]:
        """Per event, the positions in ``bw_pre_order`` of the calls inside their backward there (begun, not ended).

        A checkpointed call keeps what ``torch.utils.checkpoint`` holds for it (inputs, stashed RNG state) until
        its backward ends, so these are the calls whose overhead an event still carries after their recompute:
        the event's module and its enclosing modules, among the calls begun and not reported ended. Forward and ``other`` events: none. Events without ``bw_done`` (older stats): at ``rc``
        events the recomputed call alone, elsewhere none.
        """
        occ: dict[str, int] = {}
        post: dict[tuple[str, int], int] = {}
        for i, f in enumerate(self.bw_post_order):
            post[(f, occ.get(f, 0))] = i
            occ[f] = occ.get(f, 0) + 1
        occ.clear()
        ends = []  # per bw_pre position, the bw_post index where its backward ends
        for f in self.bw_pre_order:
            ends.append(post.get((f, occ.get(f, 0)), len(self.bw_post_order)))
            occ[f] = occ.get(f, 0) + 1
        out: list[tuple[int, ...]] = []
        inside: set[int] = set()  # swept in event order: backwards begin and end monotonically
        started = done = 0
        for e in self.events:
            if e.phase not in (Phase.BW, Phase.RC):
                out.append(())
                continue
            if e.bw_done < 0:
                p = e.bw_started - 1
                own = e.phase == Phase.RC and 0 <= p < len(self.bw_pre_order) and self.bw_pre_order[p] == e.module
                out.append((p,) if own else ())
                continue
            if e.bw_started < started or e.bw_done < done:  # not monotone (never seen): start over
                inside, started, done = set(), 0, 0
            for p in range(started, min(e.bw_started, len(ends))):
                # a call whose backward begins ends any earlier call of the same module that never reported its end
                # (a module whose inputs need no grad: the first pipeline stage's blocks, once per microbatch)
                inside.difference_update([q for q in inside if self.bw_pre_order[q] == self.bw_pre_order[p]])
                if ends[p] >= e.bw_done:
                    inside.add(p)
            started = max(started, e.bw_started)
            if e.bw_done > done:
                inside = {p for p in inside if ends[p] >= e.bw_done}
                done = e.bw_done
            # the engine runs one module's backward at a time: a call whose backward has not reported its end yet
            # (its hook waits on a gradient another module's backward starts from) is done once the running
            # module is neither it nor inside it, unless only its enclosing modules began after it
            out.append(tuple(sorted(p for p in inside if fqns.inside(e.module, self.bw_pre_order[p])
                                    or _enclosed_burst(self.bw_pre_order, p, started))))
        return out

    def module(self, fqn: str) -> ModuleStats:
        """Stats of module ``fqn`` (KeyError naming close matches if absent)."""
        for m in self.modules:
            if m.fqn == fqn:
                return m
        import difflib

        close = difflib.get_close_matches(fqn, [m.fqn for m in self.modules], n=3)
        raise KeyError(f"no module {fqn!r} in the stats" + (f"; did you mean {close}?" if close else ""))

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device.to_dict(),
            "model_name": self.model_name,
            "dtype": self.dtype,
            "world_size": self.world_size,
            "modules": [m.to_dict() for m in self.modules],
            "fw_pre_order": list(self.fw_pre_order),
            "fw_post_order": list(self.fw_post_order),
            "bw_pre_order": list(self.bw_pre_order),
            "bw_post_order": list(self.bw_post_order),
            "events": [e.to_dict() for e in self.events],
            "peak_bytes": self.peak_bytes,
            "peak_phase": self.peak_phase,
            "peak_module": self.peak_module,
            "peak_snapshot": self.peak_snapshot.to_dict(),
            "param_bytes": self.param_bytes,
            "grad_bytes": self.grad_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "fw_ms": self.fw_ms,
            "bw_ms": self.bw_ms,
            "optimizer_ms": self.optimizer_ms,
            "fw_flops": self.fw_flops,
            "bw_flops": self.bw_flops,
            "fingerprint": self.fingerprint,
            "input_shapes": [list(s) for s in self.input_shapes],
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelStats":
        return cls(
            device=DeviceSpec.from_dict(d["device"]),
            model_name=d["model_name"],
            dtype=d["dtype"],
            world_size=int(d["world_size"]),
            modules=tuple(ModuleStats.from_dict(m) for m in d["modules"]),
            fw_pre_order=tuple(d["fw_pre_order"]),
            fw_post_order=tuple(d["fw_post_order"]),
            bw_pre_order=tuple(d["bw_pre_order"]),
            bw_post_order=tuple(d["bw_post_order"]),
            events=tuple(MemoryEvent.from_dict(e) for e in d["events"]),
            peak_bytes=int(d["peak_bytes"]),
            peak_phase=d["peak_phase"],
            peak_module=d["peak_module"],
            peak_snapshot=MemSnapshot.from_dict(d["peak_snapshot"]),
            param_bytes=int(d["param_bytes"]),
            grad_bytes=int(d["grad_bytes"]),
            optimizer_bytes=int(d["optimizer_bytes"]),
            fw_ms=float(d["fw_ms"]),
            bw_ms=float(d["bw_ms"]),
            optimizer_ms=float(d["optimizer_ms"]),
            fw_flops=int(d["fw_flops"]),
            bw_flops=int(d["bw_flops"]),
            fingerprint=d["fingerprint"],
            input_shapes=tuple(tuple(int(x) for x in s) for s in d.get("input_shapes", ())),
            meta=dict(d.get("meta", {})),
        )


def _enclosed_burst(bw_pre_order: Sequence[str], p: int, started: int) -> bool:
    """Whether every backward begun after the ``p``-th (up to ``started``) is of a module enclosing its module.

    Modules returning the same tensor (an ``nn.Sequential`` of one block, a block ending in its output
    projection) begin their backwards at once, innermost first, on that tensor's gradient: the events after the
    burst are labelled with the outermost, while the engine runs the innermost's ops (measured: a checkpointed
    attention block's recomputation and its output ``Linear``'s backward labelled with the enclosing
    ``Sequential``, whose RNG-state stash went uncounted: +4,800 B, tests/fuzz/test_regressions.py
    ``test_attention_dropout_region_peak``). Such a call stays inside its backward until its end is reported.
    """
    mine = bw_pre_order[p]
    return p < started and all(fqns.inside(mine, bw_pre_order[q]) and bw_pre_order[q] != mine
                               for q in range(p + 1, min(started, len(bw_pre_order))))
