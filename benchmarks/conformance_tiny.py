"""Conformance table: the tiny third-party models of tests/conformance on real CPU steps.

    python3 benchmarks/conformance_tiny.py                      # every model, three budgets each
    python3 benchmarks/conformance_tiny.py hf-bert tv-vit       # some

The long tail of architectures (issue 24.3) is in tests/conformance/_longtail.py, part of the same registry.

Per model and budget (near minimum feasible, midway, near the no-AC peak): checkpointed modules, predicted
and measured peak (MiB), error = (measured - predicted) / measured, predicted and measured recomputed FLOPs,
gradients bitwise. Uses the suite's own model registry (tests/conformance/test_conformance.py).
"""

from __future__ import annotations

import importlib.util
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _suite():
    sys.path[:0] = [str(ROOT / "tests" / "conformance"), str(ROOT)]
    import conftest  # noqa: F401  (torchvision op schemas before anything imports torchvision)

    spec = importlib.util.spec_from_file_location("conformance_suite", ROOT / "tests" / "conformance" / "test_conformance.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["conformance_suite"] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    warnings.simplefilter("ignore")
    tc = _suite()
    names = sys.argv[1:] or list(tc.CASES)
    print("| model | budget | modules | predicted MiB | measured MiB | error | recomputed FLOPs predicted | measured | grads bitwise |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in names:
        t0 = time.perf_counter()
        try:
            tc._setup(n)
            for b in tc.BUDGETS:
                r = tc._report(n, b)
                print(f"| {n} | {b} | {len(tc._plan(n, b).decisions)} | {r.predicted_peak_bytes / 2**20:.3f} | "
                      f"{r.planned.peak_bytes / 2**20:.3f} | {r.peak_error:+.2%} | {r.predicted_recompute_flops:,} | "
                      f"{r.measured_recompute_flops:,} | {'yes' if r.grads_bitwise_equal else 'NO'} |", flush=True)
        except Exception as e:  # report and go on: the table is what matters
            print(f"| {n} | — | — | — | — | {type(e).__name__}: {str(e)[:300]} | | | |", flush=True)
        print(f"<!-- {n}: {time.perf_counter() - t0:.1f} s -->", flush=True)


if __name__ == "__main__":
    main()
