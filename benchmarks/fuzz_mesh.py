"""FSDP2 differential fuzzing outside pytest: seeded random cases of :mod:`sacplan.testing.fuzzmesh` (a fuzz model,
a mixed-precision policy, a budget fraction, optimizer / reshard / plan order), each predicted on the fake process
group and checked on 2 spawned gloo ranks (:func:`sacplan.testing.fuzzmesh.check_case`).

    PYTHONPATH=$PWD python3 benchmarks/fuzz_mesh.py --seeds 0:60

Each seed draws one case (``draw_case(RandomPicker(seed))``). Prints one line per case (ok / refused by torch /
the failures with the case to paste into a regression test) and a summary: cases, by policy, failures by check,
wall time (inflated on a loaded machine).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import warnings

import torch

from sacplan.testing.fuzzmesh import InvalidMeshModel, compute_dtype_step, draw_case, measure, mesh_failures, predict
from sacplan.testing.fuzzmodels import RandomPicker


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0:60", help="first:last (exclusive) seeds, default 0:60")
    args = ap.parse_args(argv)
    lo, hi = (int(x) for x in args.seeds.split(":"))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    kinds: collections.Counter[str] = collections.Counter()
    checked: collections.Counter[str] = collections.Counter()
    invalid = planned = 0
    t0 = time.perf_counter()
    for seed in range(lo, hi):
        case = draw_case(RandomPicker(seed))
        try:
            compute_dtype_step(case)
            pred = predict(case)
            fails = mesh_failures(pred, measure(case, pred.plan))
        except InvalidMeshModel as e:
            invalid += 1
            print(f"seed {seed}: refused by torch ({str(e)[:80]})", flush=True)
            continue
        except Exception as e:  # a crash is a failure too
            kinds[type(e).__name__] += 1
            print(f"seed {seed}: {type(e).__name__}: {str(e)[:300]}\n  {case!r}", flush=True)
            continue
        checked[case.policy] += 1
        planned += bool(pred.plan.decisions)
        for f in fails:
            kinds[f.split(": ", 1)[1].split(" off by")[0].split(" (")[0]] += 1
        label = f"{case.policy}, {len(pred.plan.decisions)} checkpointed, predicted {pred.plan.predicted_peak_bytes} B"
        print(f"seed {seed} ({label}): " + ("ok" if not fails else "FAILED\n  " + "\n  ".join(fails) + f"\n  {case!r}"),
              flush=True)
    secs = time.perf_counter() - t0
    print(f"{hi - lo} cases ({invalid} refused by torch itself), {sum(checked.values())} checked on 2 gloo ranks "
          f"{dict(checked)} ({planned} with a non-empty plan), {secs:.0f} s; failures: {dict(kinds) or 'none'}")
    return 1 if kinds else 0


if __name__ == "__main__":
    sys.exit(main())
