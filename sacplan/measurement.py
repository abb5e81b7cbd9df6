"""Measuring a real training step's peak memory and time: on CUDA ``torch.cuda.max_memory_allocated``; on CPU the
bytes live at the step's start (:func:`live_bytes` of :func:`state_tensors`) plus the allocator's own events
(``torch.profiler``), cross-checked by sacplan's tracker run on the real tensors (:func:`tracker_step_peak`)."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from sacplan.collector.calling import Inputs
from sacplan.collector.workspace import profiled_cpu_peak
from sacplan.devices import CPU
from sacplan.stats import Phase

__all__ = ["live_bytes", "measure_step", "register_state", "rng_states_registered", "state_tensors", "tracker_step_peak"]


def live_bytes(objs: Iterable[Any]) -> int:
    """Bytes of the distinct non-empty storages behind the tensors in ``objs`` (non-tensors are skipped)."""
    seen: set[int] = set()
    total = 0
    for t in objs:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            if st.data_ptr() not in seen and st.nbytes() > 0:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def state_tensors(model: nn.Module, opt: torch.optim.Optimizer | None, args: Inputs) -> list[torch.Tensor]:
    """The tensors live across a step: parameters, buffers, gradients, optimizer state and the inputs."""
    ts: list[torch.Tensor] = list(model.parameters()) + list(model.buffers())
    ts += [p.grad for p in model.parameters() if p.grad is not None]
    if opt is not None:
        for s in opt.state.values():
            ts += [v for v in s.values() if isinstance(v, torch.Tensor)]
    ts += [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
    return ts


def _cpu_profiled_peak(fn: Callable[[], None], live_at_start: int) -> int:
    """Peak bytes of ``fn()`` on CPU: bytes live at its start plus the allocator events' running peak."""
    return live_at_start + profiled_cpu_peak(fn)


def measure_step(
    model: nn.Module,
    args: Inputs,
    step: Callable[[], None],
    opt: torch.optim.Optimizer | None,
    device: torch.device,
    *,
    track: bool = True,
) -> tuple[int, int | None, float]:
    """Peak bytes (and the tracker's peak on CPU) and time of one call of ``step``."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated()), None, float(start.elapsed_time(end))
    live = live_bytes(state_tensors(model, opt, args))
    t0 = time.perf_counter()
    peak = _cpu_profiled_peak(step, live)
    ms = (time.perf_counter() - t0) * 1e3
    tracker = None
    if track:
        tracker = tracker_step_peak(model, args, step, opt)
    return peak, tracker, ms


def tracker_step_peak(model: nn.Module, args: Inputs, step: Callable[[], None], opt: torch.optim.Optimizer | None) -> int:
    """Peak bytes of one call of ``step`` by sacplan's own tracker on the real (CPU) tensors.

    An independent cross-check of the profiler's peak: the state (parameters, buffers, gradients,
    optimizer state, inputs) is registered first, so the peak includes it.
    """
    from sacplan.collector.records import GRAD
    from sacplan.collector.runtime import RuntimeModel
    from sacplan.collector.tracker import StepRecorder

    rec = StepRecorder(model, CPU, RuntimeModel(CPU))
    handles = [p.register_post_accumulate_grad_hook(lambda p: rec.relabel(p.grad, GRAD)) for p in model.parameters() if p.requires_grad]
    try:
        with rec:
            register_state(rec, model, opt, args)
            step()
            rec.close_segment(Phase.OTHER)
    finally:
        for h in handles:
            h.remove()
    return rec.step_peak


def register_state(rec: Any, model: nn.Module, opt: torch.optim.Optimizer | None, args: Inputs) -> None:
    """Register the step's live state with a recorder entered on real tensors (parameters, buffers, gradients,
    optimizer state, inputs), close the segment before the step and start recording."""
    from sacplan.collector.records import BUFFER, GRAD, INPUT, OPT, PARAM

    rec.register(list(model.parameters()), PARAM)
    rec.register(list(model.buffers()), BUFFER)
    rec.register([p.grad for p in model.parameters() if p.grad is not None], GRAD)
    if opt is not None:
        for s in opt.state.values():
            rec.register([v for v in s.values() if isinstance(v, torch.Tensor)], OPT)
    rec.register(args, INPUT)
    rec.close_segment()
    rec.recording = True


@contextlib.contextmanager
def rng_states_registered(rec: Any) -> Iterator[None]:
    """Inside, every ``torch.get_rng_state()`` result is registered with the recorder ``rec`` as it is made: the CPU
    RNG state ``torch.utils.checkpoint`` stashes per region is made outside the dispatcher, and lives while the
    checkpoint holds it."""
    from sacplan.collector.records import OTHER

    get_state = torch.get_rng_state

    def get_rng_state() -> torch.Tensor:
        t = get_state()
        rec.register(t, OTHER)
        return t

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = get_state
