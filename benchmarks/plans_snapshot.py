"""Snapshot of the plans `solve` returns on the synthetic Llama trees, to prove a refactor changes no plan.

Usage::

    python3 benchmarks/plans_snapshot.py before.json     # on the old commit
    python3 benchmarks/plans_snapshot.py after.json      # on the new one
    python3 benchmarks/plans_snapshot.py --compare before.json after.json
    python3 benchmarks/plans_snapshot.py --conformance before.json   # also the tiny conformance models
    python3 benchmarks/plans_snapshot.py --graph before.json         # also sac_milp on PyTorch's Graph

Per tree (4 blocks; 8 blocks collected for 2 ranks) and budget (10%, 50%, 90% of the way from the minimum feasible
budget to the no-checkpointing peak): the predicted peak (bytes), the recompute ms (9 digits) and every decision's
module and discard ratio, plus the same budget planned for one rank (its peak, or the infeasibility message).
With ``--conformance``, also the tiny third-party models of tests/conformance (collected on fakes, as the suite
does), at the suite's three budgets, at gap 2% (the suite's) and at the default gap, with the default work limit (and a
120 s wall-clock safety net). With ``--graph``, also ``sac_milp`` on PyTorch's ``ilp_utils.Graph`` of two Llama trees and
12 random trees at five budgets each (the Graph adapter's path: decisions, ms, peak).
`--compare` prints the keys that differ (saying when the recompute ms is equal: a tie broken differently) and exits 1
if any does.
"""

from __future__ import annotations

import json
import sys
import warnings


def snapshot() -> dict[str, object]:
    import sacplan
    from sacplan.solver import min_feasible_budget, solve
    from sacplan.testing.llama_tree import llama_tree

    out: dict[str, object] = {}
    for kw in (dict(n_blocks=4), dict(n_blocks=8, world_size=2)):
        tree = llama_tree(**kw)
        lo, hi = min_feasible_budget(tree), sacplan.baseline_peak(tree)
        out[f"{kw} min feasible"] = int(lo)
        for f in (0.1, 0.5, 0.9):
            b = int(lo + f * (hi - lo))
            p = solve(tree, f"{b}B", time_limit_s=30)
            out[f"{kw} {f}"] = [p.predicted_peak_bytes, round(p.recompute_ms, 9),
                                sorted((d.fqn, round(d.discard_ratio, 9)) for d in p.decisions)]
            try:
                out[f"{kw} {f} one rank"] = solve(tree, f"{b}B", world_size=1, time_limit_s=30).predicted_peak_bytes
            except sacplan.InfeasibleBudgetError as e:
                out[f"{kw} {f} one rank"] = str(e)
    return out


def graph_snapshot() -> dict[str, object]:
    """``sac_milp`` on PyTorch's Graph (tests/solver/test_compat.py's trees, and more random ones), five budgets each."""
    import copy
    import random

    from torch.distributed._tools.ilp_utils import get_peak_memory_runtime_baseline, parse_module_info

    from sacplan.solver import sac_milp
    from sacplan.testing.llama_tree import llama_tree
    from sacplan.testing.synthetic import GiB, build_tree, random_spec

    trees = [("llama2", llama_tree(2)), ("llama3", llama_tree(3, with_ops=False))]
    trees += [(f"random{seed}", build_tree(random_spec(random.Random(seed), max_modules=8))) for seed in range(12)]
    out: dict[str, object] = {}
    for name, tree in trees:
        info = tree.to_torch_module_info()
        peak, _ = get_peak_memory_runtime_baseline(parse_module_info(copy.deepcopy(info)))
        for frac in (0.95, 0.8, 0.6, 0.45, 0.3):
            ratios, ms, got = sac_milp(parse_module_info(copy.deepcopy(info)), peak * frac / GiB)
            out[f"graph {name} {frac}"] = [sorted(ratios.items()), ms, got]
    return out


def conformance_snapshot() -> dict[str, object]:
    """The tiny conformance models' plans (tests/conformance's registry and budgets)."""
    import importlib.util
    from pathlib import Path

    from sacplan.solver import solve

    root = Path(__file__).resolve().parents[1] / "tests" / "conformance"
    sys.path[:0] = [str(root), str(root.parents[1])]  # the suite imports tests.conformance._longtail
    import conftest  # noqa: F401  (torchvision op schemas before anything imports torchvision)

    spec = importlib.util.spec_from_file_location("conformance_suite", root / "test_conformance.py")
    tc = importlib.util.module_from_spec(spec)
    sys.modules["conformance_suite"] = tc
    spec.loader.exec_module(tc)
    out: dict[str, object] = {}
    for name in tc.CASES:
        try:
            _, tree, budgets = tc._setup(name)
        except Exception as e:  # a library missing here: say so, the other models still count
            out[f"{name}"] = f"not collected: {type(e).__name__}"
            continue
        for b, v in budgets.items():
            for gap in (0.02, 1e-4):
                # the default work limit ends the search; the wall clock (120 s) only as the safety net, which
                # the entry names when it fired (then the plan depends on the load: not comparable)
                p = solve(tree, v, gap_rel=gap, time_limit_s=120)
                out[f"{name} {b} gap {gap}"] = [p.predicted_peak_bytes, round(p.recompute_ms, 9), p.status,
                                                 sorted((d.fqn, round(d.discard_ratio, 9)) for d in p.decisions),
                                                 p.meta.get("stopped_by", [])]
    return out


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Snapshot the plans solve returns, or compare two snapshots.")
    ap.add_argument("out", nargs="?", help="the JSON file to write the snapshot to")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="print the entries that differ")
    ap.add_argument("--conformance", action="store_true", help="also the tiny conformance models")
    ap.add_argument("--graph", action="store_true", help="also sac_milp on PyTorch's Graph")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    if args.compare:
        a, b = (json.load(open(p)) for p in args.compare)
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        for k in diff:
            x, y = a.get(k), b.get(k)
            same_cost = isinstance(x, list) and isinstance(y, list) and x[1] == y[1]
            print(f"differs: {k}: {x if not same_cost else x[:2]} -> {y if not same_cost else y[:2]}"
                  + (" (equal recompute ms: a tie broken differently)" if same_cost else ""))
        if not diff:
            print(f"all {len(a)} entries equal")
        return 1 if diff else 0
    if not args.out:
        ap.error("name the snapshot file to write (or --compare BEFORE AFTER)")
    out = snapshot()
    if args.conformance:
        out.update(conformance_snapshot())
    if args.graph:
        out.update(graph_snapshot())
    with open(args.out, "w") as f:
        json.dump(out, f, indent=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
