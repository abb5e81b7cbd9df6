"""Differential fuzzing outside pytest: seeded random models of :mod:`sacplan.testing.fuzzmodels`, each planned at
random budgets and checked against its unplanned CPU step (:func:`sacplan.testing.fuzzcheck.check_spec`).

    python3 benchmarks/fuzz.py --seeds 0:200            # the grammar tests/fuzz checks (fuzzmodels.CHECKED)
    python3 benchmarks/fuzz.py --seeds 0:50 --full      # everything, open failures included (CPU bf16 autocast)
    python3 benchmarks/fuzz.py --seeds 0:10 --compiled  # repeated blocks validated compiled (Inductor, ~20 s each)

Each seed draws one model (``RandomPicker(seed)``) and ``--budgets`` fractions between the minimum feasible budget
and the no-checkpointing peak. Prints one line per failure (the spec to paste into a regression test) and a
summary: models, plans checked, failures by check, models and failing models per precision and per optimizer, wall
time (inflated on a loaded machine).
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import time
import warnings

import torch

from sacplan.testing.fuzzcheck import InvalidModel, check_compiled, check_spec
from sacplan.testing.fuzzmodels import CHECKED, Grammar, RandomPicker, draw_repeated_spec, draw_spec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0:50", help="first:last (exclusive) seeds, default 0:50")
    ap.add_argument("--budgets", type=int, default=1, help="budget fractions per model (default 1)")
    ap.add_argument("--full", action="store_true", help="the whole grammar, constructs with open failures included")
    ap.add_argument("--compiled", action="store_true",
                    help="models of repeated blocks validated with compile=True (fuzzcheck.check_compiled)")
    args = ap.parse_args(argv)
    lo, hi = (int(x) for x in args.seeds.split(":"))
    grammar = Grammar() if args.full else CHECKED
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    kinds: collections.Counter[str] = collections.Counter()
    axes: collections.Counter[str] = collections.Counter()  # models per precision / optimizer
    failed: collections.Counter[str] = collections.Counter()  # failing models per precision / optimizer
    plans = invalid = 0
    t0 = time.perf_counter()
    for seed in range(lo, hi):
        spec = (draw_repeated_spec if args.compiled else draw_spec)(RandomPicker(seed), grammar)
        rng = random.Random(seed)
        fractions = tuple(round(rng.random(), 2) for _ in range(args.budgets))
        labels = (f"precision {spec.precision}", f"optimizer {spec.optimizer}")
        try:
            if args.compiled:
                checks = [check_compiled(spec, f) for f in fractions]
            else:
                checks = check_spec(spec, fractions)
        except InvalidModel:
            invalid += 1
            continue
        except Exception as e:  # a crash is a failure too
            kinds[type(e).__name__] += 1
            axes.update(labels)
            failed.update(labels)
            print(f"seed {seed}: {type(e).__name__}: {str(e)[:200]}\n  {spec!r}", flush=True)
            continue
        axes.update(labels)
        if any(c.failures for c in checks):
            failed.update(labels)
        for c in checks:
            plans += 1
            for f in c.failures:
                kinds[f.split(" (")[0].split(" by ")[0]] += 1
            if c.failures:
                print(f"seed {seed} fraction {c.fraction}: {'; '.join(c.failures)}\n  {spec!r}", flush=True)
    secs = time.perf_counter() - t0
    print(f"{hi - lo} models ({invalid} refused by torch itself), {plans} plans checked, {secs:.0f} s; failures: "
          f"{dict(kinds) or 'none'}")
    print("models (failing) per axis: " + ", ".join(f"{k} {n} ({failed[k]})" for k, n in sorted(axes.items())))
    return 1 if kinds else 0


if __name__ == "__main__":
    sys.exit(main())
