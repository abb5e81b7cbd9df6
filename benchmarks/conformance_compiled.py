"""Compiled cells of the conformance table: tiny third-party models, real CPU steps compiled with Inductor.

    python3 benchmarks/conformance_compiled.py      # nn-encoder, hf-llama-gqa, llama-4-blocks, tv-resnet18
    python3 benchmarks/conformance_compiled.py hf-gpt2 --budget near-min --compile model

Per model: :func:`sacplan.validate` with ``compile=True`` (each repeated block compiled, as torchtitan does;
``--compile model`` for the whole model) at one of the suite's budgets (default midway), beside the prediction
for the compiled step (``sacplan.compiled_partition``: each block compiled on fake tensors, Inductor's code run
without kernels in a fake step; the seconds it took are printed after each row): measured and predicted peaks
without and with the plan, error = (measured - predicted) / measured (negative: the compiled step needs less
than predicted), gradients (compiled steps are not always bitwise equal: Inductor fuses differently with
recomputation). Set ``TORCHINDUCTOR_CACHE_DIR`` to reuse compiled code between runs. Recomputed FLOPs are not counted under compile. Uses the
suite's own model registry and budgets (tests/conformance/test_conformance.py, via conformance_tiny.py).
Inductor compiles every graph with the host's C++ compiler: minutes per model on 2 cores.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import conformance_tiny  # noqa: E402

from sacplan.validation import validate  # noqa: E402

DEFAULT = ("nn-encoder", "hf-llama-gqa", "llama-4-blocks", "tv-resnet18")
#: models besides the suite's: sacplan's own Llama preset with 4 blocks (batch 2, seq 64)
EXTRA = ("llama-4-blocks",)


def _extra_case(name: str, budget: str, tc: Any) -> tuple[Any, Any]:
    """(case, plan) of a model in :data:`EXTRA`, planned at the suite's budget points with its solver settings."""
    from sacplan import ModuleTree, collect, solve
    from sacplan.models import get_model
    from sacplan.solver import min_feasible_budget
    from sacplan.units import Bytes

    p = get_model("llama-tiny")
    x = p.example_inputs(2, 64)
    case = tc.Case(lambda: p.build(n_layers=4), lambda: x, p.loss_fn, "torch")
    tree = ModuleTree(collect(case.build, case.inputs(), device="cpu", loss_fn=case.loss, optimizer=False))
    lo, hi = min_feasible_budget(tree), tree.stats.peak_bytes
    at = {"near-min": lo + (hi - lo) // 50, "midway": (lo + hi) // 2, "near-peak": hi - (hi - lo) // 20}[budget]
    return case, solve(tree, Bytes(at), gap_rel=0.02, time_limit_s=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=list(DEFAULT))
    ap.add_argument("--budget", default="midway", choices=("near-min", "midway", "near-peak"))
    ap.add_argument("--compile", default=True, choices=("blocks", "model"))
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    tc = conformance_tiny._suite()
    print("| model | budget | compiled | modules | no plan: predicted MiB | measured | error | with plan: predicted MiB "
          "| measured | error | grads |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n in args.models:
        t0 = time.perf_counter()
        try:
            case, plan = _extra_case(n, args.budget, tc) if n in EXTRA else (tc._setup(n)[0], tc._plan(n, args.budget))
            stages: list[float] = []
            r = validate(case.build, case.inputs, plan, loss_fn=case.loss, optimizer=False, device="cpu",
                         compile=args.compile, timed_steps=0, progress=lambda _s: stages.append(time.perf_counter()))
            grads = "bitwise" if r.grads_bitwise_equal else f"max diff {r.max_grad_abs_diff:.2g}" + (
                "" if r.grads_match else " NO" if r.grads_compared else " (dropout: not compared)")
            print(f"| {n} | {args.budget} | {r.compiled} | {len(plan.decisions)} | "
                  f"{r.predicted_baseline_peak_bytes / 2**20:.3f} | {r.baseline.peak_bytes / 2**20:.3f} | {r.baseline_peak_error:+.2%} | "
                  f"{r.predicted_peak_bytes / 2**20:.3f} | {r.planned.peak_bytes / 2**20:.3f} | {r.peak_error:+.2%} | {grads} |",
                  flush=True)
            print(f"<!-- {n} bytes, predicted / measured: no plan {r.predicted_baseline_peak_bytes} / {r.baseline.peak_bytes}, "
                  f"with plan {r.predicted_peak_bytes} / {r.planned.peak_bytes}; prediction "
                  f"{stages[1] - stages[0]:.1f} s -->", flush=True)
        except Exception as e:  # report and go on: the table is what matters
            print(f"| {n} | {args.budget} | — | — | — | — | — | — | — | {type(e).__name__}: {str(e)[:300]} | |", flush=True)
        print(f"<!-- {n}: {time.perf_counter() - t0:.1f} s -->", flush=True)


if __name__ == "__main__":
    main()
