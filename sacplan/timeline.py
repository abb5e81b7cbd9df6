"""The step's memory timeline: sacplan's one memory model.

Every question "what is the peak of this step under this checkpointing choice?" is answered here, by
:meth:`Timeline.peaks`: the solver's exact evaluation (:class:`sacplan.solver.milp.SacProblem`), the evaluation
of any given choice (:func:`sacplan.evaluate.event_peaks`, used by validate, the alternatives and the plots)
and, through the same event arrays, the MILP's rows.

For event ``e`` (a :class:`~sacplan.stats.MemoryEvent`) with recorded peak ``peak_e`` and state ``S_e``
(params + grads + optimizer state), planned for ``world_size`` ranks when the stats hold ``w0``:

* ``base_e = peak_e - S_e·(1 - w0/world_size)`` (FSDP's per-rank state scales with ``1/world_size``);
* forward:   ``base_e - F[fw_done_e]``          (what calls whose forward finished freed);
* backward and rc: ``base_e - (D - B[bw_started_e])``  (what calls not yet re-materialised freed);
* interleaved (a forward event after some backward began, or a backward/rc event before every forward
  finished, as in a pipeline stage's schedule or gradient accumulation): ``base_e - (F[fw_done_e] - B[bw_started_e])``
  (what the calls whose forward finished and whose backward has not begun freed; :attr:`Timeline.mixed`);
* other:     ``base_e``;

plus whatever a choice adds at an event (``added``): the overhead of checkpointed calls inside their backward
there (:meth:`Timeline.held`) and, at a checkpointed call's rc event, its recompute transient and surge. ``F``
and ``B`` are running sums of the bytes each module call frees (discard minus what checkpointing keeps for it)
along ``fw_post_order`` and ``bw_pre_order``; ``D`` is ``B``'s total. All sizes are bytes.

A step that runs a module's forward and backward several times in an interleaved order (pipeline parallelism:
:mod:`sacplan.pipeline` collects a stage over its schedule's microbatches) lists every call in both orders, so a
decision frees bytes at every call of a checkpointed module, and the in-flight multiplicity is exact: at an
interleaved event exactly the calls of the microbatches in flight count. A single forward-then-backward step has
no interleaved events (``F[n] = D``, so the forms agree where both apply).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from sacplan.errors import ConfigError
from sacplan.stats import MemoryEvent, ModelStats, Phase

#: phase codes of :attr:`Timeline.phase`
FW, BW, RC, OTHER = 0, 1, 2, 3
PHASE_CODES = {Phase.FW: FW, Phase.BW: BW, Phase.RC: RC, Phase.OTHER: OTHER}


def check_world_size(world_size: object) -> int:
    """``world_size`` as an int >= 1, or :class:`~sacplan.errors.ConfigError` saying what is wrong."""
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    return int(world_size)


def call_entries(order: Sequence[str]) -> tuple[tuple[str, int], ...]:
    """``(fqn, call)`` of each entry of a module-call order: the call is that fqn's occurrence count so far."""
    seen: dict[str, int] = {}
    out = []
    for f in order:
        c = seen.get(f, 0)
        seen[f] = c + 1
        out.append((f, c))
    return tuple(out)


@dataclass(frozen=True, eq=False)
class Timeline:
    """The memory events of one collected step, planned for ``world_size`` ranks (arrays are per event).

    Attributes:
        world_size: ranks planned for.
        state_keep: state bytes kept per rank relative to the collected ones (``w0 / world_size``).
        phase: phase code per event (:data:`FW`, :data:`BW`, :data:`RC`, :data:`OTHER`).
        module: fqn of the module running at each event.
        base: bytes at each event without checkpointing, state scaled to ``world_size`` (float).
        pos: forward events: ``fw_done`` clamped to the order's length; backward/rc: ``bw_started``; else 0.
        extra: recompute transient bytes at rc events (``MemoryEvent.extra_bytes``), 0 elsewhere.
        fw_entries, bw_entries: ``(fqn, call)`` along ``fw_post_order`` / ``bw_pre_order``.
        active_event, active_pos: pairs (event, position in ``bw_pre_order``) of the calls inside their backward
            at that event (:meth:`~sacplan.stats.ModelStats.backward_active`).
        fw_pos, bw_pos: per event, ``fw_done`` and ``bw_started`` clamped to the orders' lengths (0 at other events).
        mixed: per event, True where forwards and backwards interleave (module docstring): a forward event with
            ``bw_pos > 0`` or a backward/rc event with ``fw_pos`` short of ``fw_post_order``'s length.
    """

    world_size: int
    state_keep: float
    phase: np.ndarray
    module: tuple[str, ...]
    base: np.ndarray
    pos: np.ndarray
    extra: np.ndarray
    fw_entries: tuple[tuple[str, int], ...]
    bw_entries: tuple[tuple[str, int], ...]
    active_event: np.ndarray
    active_pos: np.ndarray
    fw_pos: np.ndarray
    bw_pos: np.ndarray
    mixed: np.ndarray

    @classmethod
    def of(cls, stats: ModelStats, world_size: int | None = None) -> "Timeline":
        """The timeline of ``stats`` for ``world_size`` ranks (None: the stats' own).

        Stats without events (no timeline recorded) get one ``other`` event at the whole step's peak, which no
        checkpointing changes.

        Raises:
            ConfigError: ``world_size`` not an integer >= 1, or an event with an unknown phase.
        """
        w0 = max(1, int(stats.world_size))
        ws = check_world_size(w0 if world_size is None else world_size)
        keep = w0 / ws
        events = list(stats.events)
        active = stats.backward_active() if events else [()]
        if not events:
            events = [MemoryEvent(Phase.OTHER, "", 0, 0, 0, int(stats.peak_bytes), int(stats.peak_snapshot.state))]
        n = len(events)
        nf, nb = len(stats.fw_post_order), len(stats.bw_pre_order)
        phase = np.empty(n, dtype=np.int64)
        base = np.empty(n, dtype=float)
        pos = np.zeros(n, dtype=np.int64)
        extra = np.zeros(n, dtype=float)
        fpos = np.zeros(n, dtype=np.int64)
        bpos = np.zeros(n, dtype=np.int64)
        for i, e in enumerate(events):
            ph = PHASE_CODES.get(e.phase)  # type: ignore[call-overload]
            if ph is None:
                raise ConfigError(f"memory event {i} has unknown phase {e.phase!r} (expected fw, bw, rc or other)")
            phase[i] = ph
            base[i] = float(e.peak_bytes) - float(e.state_bytes) * (1.0 - keep)
            if ph != OTHER:
                fpos[i] = min(max(int(e.fw_done), 0), nf)
                bpos[i] = min(max(int(e.bw_started), 0), nb)
            if ph == FW:
                pos[i] = min(max(int(e.fw_done), 0), nf)
            elif ph in (BW, RC):
                pos[i] = min(max(int(e.bw_started), 0), nb)
                if ph == RC:
                    extra[i] = float(e.extra_bytes)
        pairs = [(i, p) for i, act in enumerate(active) for p in act if p < nb]
        return cls(
            world_size=ws,
            state_keep=keep,
            phase=phase,
            module=tuple(e.module for e in events),
            base=base,
            pos=pos,
            extra=extra,
            fw_entries=call_entries(stats.fw_post_order),
            bw_entries=call_entries(stats.bw_pre_order),
            active_event=np.asarray([i for i, _ in pairs], dtype=np.int64),
            active_pos=np.asarray([p for _, p in pairs], dtype=np.int64),
            fw_pos=fpos,
            bw_pos=bpos,
            mixed=((phase == FW) & (bpos > 0)) | (((phase == BW) | (phase == RC)) & (fpos < nf)),
        )

    @property
    def num_events(self) -> int:
        return len(self.phase)

    def running(self, fw_freed: np.ndarray, bw_freed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The running sums ``(F, G)`` of what calls free (module docstring): ``F[k]`` = bytes the first ``k``
        calls of ``fw_post_order`` freed at their forwards' ends, ``G[k]`` = bytes the calls ``k..`` of
        ``bw_pre_order`` freed and have not yet got back (``D - B[k]``). ``fw_freed``/``bw_freed`` are per call
        (bytes), 1-D or 2-D (calls × columns: the running sums of every column at once, for linear forms)."""
        fw = np.asarray(fw_freed, dtype=float)
        bw = np.asarray(bw_freed, dtype=float)
        F = np.concatenate([np.zeros((1,) + fw.shape[1:]), np.cumsum(fw, axis=0)])
        B = np.concatenate([np.zeros((1,) + bw.shape[1:]), np.cumsum(bw, axis=0)])
        return F, B[-1] - B

    def freed(self, fw_freed: np.ndarray, bw_freed: np.ndarray) -> np.ndarray:
        """Per event, the bytes the calls' frees take off it: ``F[fw_done]`` at forward events, ``G[bw_started]``
        at backward and rc events, ``F[fw_done] + G[bw_started] - G[0]`` at interleaved ones (:attr:`mixed`), 0 at
        others (:meth:`running`; 2-D inputs give events × columns)."""
        F, G = self.running(fw_freed, bw_freed)
        out = np.zeros((self.num_events,) + F.shape[1:])
        fw = (self.phase == FW) & ~self.mixed
        out[fw] = F[self.pos[fw]]
        bw = ((self.phase == BW) | (self.phase == RC)) & ~self.mixed
        out[bw] = G[self.pos[bw]]
        mx = self.mixed
        out[mx] = F[self.fw_pos[mx]] + G[self.bw_pos[mx]] - G[0]
        return out

    def peaks(self, fw_freed: np.ndarray, bw_freed: np.ndarray, added: np.ndarray | None = None) -> np.ndarray:
        """Bytes at every event (float array) when the ``k``-th call of ``fw_post_order`` frees ``fw_freed[k]``
        bytes at its forward's end and the ``k``-th of ``bw_pre_order`` gets ``bw_freed[k]`` back at its
        backward's start (both: discards minus what checkpointing keeps; zero for calls not checkpointed),
        plus ``added`` per event (see :meth:`held` and the module docstring)."""
        m = self.base - self.freed(fw_freed, bw_freed)
        if added is not None:
            m += added
        return m

    def held(self, bw_kept: np.ndarray) -> np.ndarray:
        """Per event, the bytes checkpointed calls keep there while inside their backward: the sum of
        ``bw_kept[p]`` (what the ``p``-th call of ``bw_pre_order`` keeps, bytes) over the calls active at it."""
        w = np.asarray(bw_kept, dtype=float)[self.active_pos] if len(self.active_pos) else np.zeros(0)
        return np.bincount(self.active_event, weights=w, minlength=self.num_events).astype(float)
