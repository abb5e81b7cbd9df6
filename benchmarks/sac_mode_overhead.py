"""What the selective-checkpoint dispatch mode costs in step time, and what running fully checkpointed regions as
plain checkpointing gives back.

    python3 benchmarks/sac_mode_overhead.py                        # GPU host: the saved plans of cuda_validation
    python3 benchmarks/sac_mode_overhead.py --device cpu --cases llama-small --plans DIR   # smoke run

For every case of ``benchmarks/cuda_validation.py`` and each saved plan (``benchmarks/cuda_plans``), one model on
the device, timed steps (forward, backward, ``zero_grad``; CUDA events, or wall time on the CPU) interleaved in
rounds so drift hits every variant alike:

* ``none``: no plan;
* ``plan``: the plan as ``apply_plan`` runs it (fully checkpointed regions of modules without buffers run as
  plain ``torch.utils.checkpoint``);
* ``all-selective``: the same plan with every region under the selective mode (what apply did before).

Printed: the median step ms of each variant, the plan's estimated recompute ms, and per variant the measured
extra over ``none``. Same plan, same recomputation, same bytes: only the dispatch overhead differs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from cuda_validation import CASES  # noqa: E402  (the benchmark's cases, one definition)


def step_timer(dev: torch.device) -> Callable[[Callable[[], None]], float]:
    def timed(step: Callable[[], None]) -> float:
        if dev.type != "cuda":
            t = time.perf_counter()
            step()
            return (time.perf_counter() - t) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    return timed


def _planned_forwards(model: torch.nn.Module) -> list[Any]:
    return [m.forward for m in model.modules() if hasattr(m.forward, "full")]


def built_case(name: str, dev: torch.device) -> tuple[torch.nn.Module, Any, Callable[[Any, Any], torch.Tensor]]:
    """(model in training mode on ``dev`` in the case's dtype, its arguments on ``dev``, the two-argument loss) of
    a case of ``cuda_validation.py``."""
    from sacplan.collector.calling import as_inputs, as_loss

    case = CASES[name]()
    torch.manual_seed(0)
    model = case["build"]().to(dev)
    if case["dtype"] is not None:
        model.to(case["dtype"])
    model.train()
    args = tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, as_inputs(case["inputs"]()))
    return model, args, as_loss(case["loss"])


def time_case(name: str, plan: Any, dev: torch.device, rounds: int) -> dict[str, Any]:
    """Median step ms of ``none`` / ``plan`` / ``all-selective`` for one case and plan."""
    from sacplan.apply import apply_plan, remove_plan
    from sacplan.collector.calling import call_model

    model, args, loss = built_case(name, dev)

    def step() -> None:
        loss(call_model(model, args), args).backward()
        model.zero_grad(set_to_none=True)

    def variant(v: str) -> int:
        """Applies variant ``v``; the number of regions that run as plain checkpointing."""
        remove_plan(model)
        if v == "none":
            return 0
        apply_plan(model, plan)
        wrappers = _planned_forwards(model)
        for w in wrappers:
            w.full = w.full and v == "plan"
            w.checked = True  # the steady state: a region without RNG state runs its first call under the policy
        return sum(1 for w in wrappers if w.full and next(w.module.buffers(), None) is None)

    timed, times, plain = step_timer(dev), {"none": [], "plan": [], "all-selective": []}, 0
    for v in times:  # warm-up: allocator, kernels, autotuning
        plain = max(plain, variant(v))
        step()
    for _ in range(rounds):
        for v in times:
            variant(v)
            times[v].append(timed(step))
    remove_plan(model)
    med = {v: statistics.median(t) for v, t in times.items()}
    return {"case": name, "units": len(plan.decisions), "plain": plain, "est_recompute_ms": plan.recompute_ms,
            **{f"{v} ms": m for v, m in med.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="*", default=["llama-1b", "gpt2", "vit-b16", "resnet50"])
    ap.add_argument("--plans", default=str(HERE / "cuda_plans"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    from sacplan.plan import load_plan

    dev = torch.device(args.device)
    print(f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}  torch {torch.__version__}", flush=True)
    print(f"{'case':<10} {'budget':<6} {'units':>5} {'plain':>5} {'est rc ms':>9} {'none ms':>8} {'plan ms':>8} "
          f"{'all-sel ms':>10} {'plan extra':>10} {'all-sel extra':>13}", flush=True)
    for name in args.cases:
        for label in ("mid", "tight"):
            path = Path(args.plans) / f"{name}.{label}.json"
            if not path.exists():
                continue
            try:
                r = time_case(name, load_plan(path), dev, args.rounds)
            except Exception as e:  # keep timing the other cases
                print(f"{name:<10} {label:<6} error: {type(e).__name__}: {e}"[:300], flush=True)
                continue
            n, p, s = r["none ms"], r["plan ms"], r["all-selective ms"]
            print(f"{name:<10} {label:<6} {r['units']:>5} {r['plain']:>5} {r['est_recompute_ms']:>9.1f} {n:>8.1f} {p:>8.1f} "
                  f"{s:>10.1f} {p - n:>+10.1f} {s - n:>+13.1f}", flush=True)
            if dev.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
