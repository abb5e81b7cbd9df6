"""One rank's measured FSDP2 step, shared by the mixed-precision and 2-D mesh tests.

:func:`measure_rank` builds the Llama twice (same seed), parallelizes both with ``parallelize(model)``, applies
the plan to one of them (before or after ``parallelize``), runs two steps (optimizer state exists, as in
``collect``), then measures the least peak of the third to fifth steps of each (see measure_rank) with sacplan's StepRecorder on the real tensors (the local
shards are registered as state), and compares the first step's local gradients bitwise.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch


def local(t: Any) -> Any:
    """The local shard of a DTensor (a plain tensor unchanged)."""
    return t.to_local() if hasattr(t, "to_local") else t


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[list, list]:
    params = [local(p) for p in model.parameters()]
    opt_state = [local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return params, opt_state


def recorded_peak(model: torch.nn.Module, opt: torch.optim.Optimizer, toks: torch.Tensor, step: Callable[[], None]) -> tuple[int, str]:
    """Peak bytes of ``step()`` by the StepRecorder with the rank's state registered (bytes, where)."""
    from sacplan.collector.records import BUFFER, INPUT, OPT, PARAM
    from sacplan.collector.runtime import RuntimeModel
    from sacplan.collector.tracker import StepRecorder
    from sacplan.devices import CPU

    params, opt_state = state_of(model, opt)
    rec = StepRecorder(model, CPU, RuntimeModel(CPU))
    with rec:
        rec.register(params, PARAM)
        rec.register([local(b) for b in model.buffers()], BUFFER)
        rec.register(opt_state, OPT)
        rec.register((toks,), INPUT)
        rec.close_segment()
        rec.recording = True
        step()
        rec.close_segment("other")
    return rec.step_peak, rec.step_peak_where


def _stepper(runner: Any, opt: torch.optim.Optimizer, loss_fn: Callable[[Any, Any], torch.Tensor], toks: torch.Tensor) -> Callable[[], None]:
    """One training step of ``runner`` (forward, backward, optimizer step, gradients dropped)."""

    def step() -> None:
        loss = loss_fn(runner(toks), toks)
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def measure_rank(
    build: Callable[[], torch.nn.Module],
    parallelize: Callable[[torch.nn.Module], torch.nn.Module],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    toks: torch.Tensor,
    plan_dict: dict,
    order: str = "before",
    reference: Callable[[], list[torch.Tensor]] | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-6,
) -> dict:
    """Peaks of the unplanned and planned step, and whether their first-step gradients are bitwise equal.

    With ``reference`` (a callable returning the single-process gradients of the whole model, in
    ``parameters()`` order), the unplanned model's full gradients are also compared with it (allclose).
    """
    from sacplan.apply import apply_plan
    from sacplan.plan import Plan

    t0 = time.perf_counter()
    plan = Plan.from_dict(plan_dict)
    out: dict[str, Any] = {}
    grads: dict[str, list[torch.Tensor]] = {}
    for label in ("plain", "planned"):
        torch.manual_seed(0)
        model = build()
        if label == "planned" and order == "before":
            apply_plan(model, plan)
        runner = parallelize(model)
        if label == "planned" and order == "after":
            apply_plan(runner, plan)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        step = _stepper(runner, opt, loss_fn, toks)

        loss = loss_fn(runner(toks), toks)
        loss.backward()
        del loss
        grads[label] = [local(p.grad).clone() for p in model.parameters()]
        if label == "plain" and reference is not None:
            full = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
            ref = reference()
            out["max_ref_diff"] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(full, ref))
            out["ref_close"] = all(torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol) for a, b in zip(full, ref))
        opt.step()
        opt.zero_grad(set_to_none=True)
        step()
        # gloo's worker threads release a collective's tensors when they get to it, so on a busy host one step
        # can hold a buffer a little longer than the schedule needs (seen: +1.7% to +8.8% on one rank, once in
        # a few runs); the least of three steps is the schedule's own peak, which is what is predicted
        peak, where = min((recorded_peak(model, opt, toks, step) for _ in range(3)), key=lambda pw: pw[0])
        out[f"{label}_peak"], out[f"{label}_where"] = peak, where
        del model, runner, opt, step
    out["bitwise"] = all(torch.equal(a, b) for a, b in zip(grads["plain"], grads["planned"]))
    out["grad_shapes"] = [list(g.shape) for g in grads["plain"]]
    out["seconds"] = time.perf_counter() - t0
    return out


def check_ranks(layout: str, results: list[dict], plan: Any, base: int) -> list[str]:
    """Report lines of :func:`measure_rank` results; raises AssertionError naming every rank outside 1% of the
    predictions (``base``: without a plan; ``plan.predicted_peak_bytes``: with it), with gradients that differ
    with the plan, or far from the single-process reference."""
    lines, failures = [], []
    for r in results:
        e0 = (r["plain_peak"] - base) / r["plain_peak"]
        e1 = (r["planned_peak"] - plan.predicted_peak_bytes) / r["planned_peak"]
        lines.append(f"{layout} rank {r['rank']}: no plan predicted {base} measured {r['plain_peak']} ({e0:+.2%}) at "
                     f"{r['plain_where']}; plan predicted {plan.predicted_peak_bytes} measured {r['planned_peak']} "
                     f"({e1:+.2%}) at {r['planned_where']}; bitwise {r['bitwise']}, max |grad - reference| "
                     f"{r['max_ref_diff']:.1e}, {r['seconds']:.1f}s")
        if abs(e0) > 0.01 or abs(e1) > 0.01:
            failures.append(f"rank {r['rank']}: peak off by more than 1%")
        if not r["bitwise"]:
            failures.append(f"rank {r['rank']}: gradients differ with the plan")
        if not r["ref_close"]:
            failures.append(f"rank {r['rank']}: gradients far from the single-process reference")
    print("\n".join(lines))
    assert not failures, "\n".join(failures + lines)
    return lines
