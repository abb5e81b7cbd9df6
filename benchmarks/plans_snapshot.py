"""Snapshot of the plans `solve` returns on the synthetic Llama trees, to prove a refactor changes no plan.

Usage::

    python3 benchmarks/plans_snapshot.py before.json     # on the old commit
    python3 benchmarks/plans_snapshot.py after.json      # on the new one
    python3 benchmarks/plans_snapshot.py --compare before.json after.json

Per tree (4 blocks; 8 blocks collected for 2 ranks) and budget (10%, 50%, 90% of the way from the minimum feasible
budget to the no-checkpointing peak): the predicted peak (bytes), the recompute ms (9 digits) and every decision's
module and discard ratio, plus the same budget planned for one rank (its peak, or the infeasibility message).
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


def main() -> int:
    warnings.simplefilter("ignore")
    if sys.argv[1:2] == ["--compare"]:
        a, b = (json.load(open(p)) for p in sys.argv[2:4])
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        for k in diff:
            x, y = a.get(k), b.get(k)
            same_cost = isinstance(x, list) and isinstance(y, list) and x[1] == y[1]
            print(f"differs: {k}: {x if not same_cost else x[:2]} -> {y if not same_cost else y[:2]}"
                  + (" (equal recompute ms: a tie broken differently)" if same_cost else ""))
        if not diff:
            print(f"all {len(a)} entries equal")
        return 1 if diff else 0
    json.dump(snapshot(), open(sys.argv[1], "w"), indent=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
