"""Why the README's default ``sacplan plan`` is slow to prove: its binding events and the nesting gap.

Usage::

    python benchmarks/default_plan_bound.py                 # the default job: llama-1b, bf16, batch 3 x seq 8192, H100, 80%
    python benchmarks/default_plan_bound.py --time-limit 120

Builds the same problem ``solve`` builds (exact options, at most 16 per module) and prints:

* how many events can exceed the budget at all (base + every overhead, transient and surge);
* the tree DP alone (:mod:`sacplan.solver.tree_dp`): its time, binding events, front sizes and optimum;
* ``solve`` at its default 60 s limit with the tree DP (its default) and without it (the MILP alone, as before
  the DP), and whether their plans are byte-identical;
* the optimum of a flat formulation over the binding events only — one binary per option, one row per
  candidate, one row per candidate–ancestor pair, one row per binding event — without nesting rows (a lower
  bound: it may checkpoint a block and its children) and with them (the optimum, exact in the same model).

Figures go to benchmarks/RESULTS.md ("Issue 14 cells"). HiGHS (highspy) must be installed.
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
import torch

import sacplan
from sacplan.solver import SolverOptions, solve
from sacplan.solver.backends import solve_model
from sacplan.solver.model import MilpModel
from sacplan.solver.problem import SacProblem
from sacplan.solver.tree_dp import solve_tree_dp
from sacplan.tree import ModuleTree
from sacplan.units import GiB, parse_budget


def flat_model(P: SacProblem, budget: int, nesting: bool) -> tuple[MilpModel, dict[tuple[int, int], int], int]:
    """The option-level MILP over the events that can exceed ``budget``; returns (model, columns, events)."""
    C, Y = P.linear_terms()
    opts = []
    for c in P.candidates:
        o = P.options(c.slot)
        opts.append((np.asarray(o.ratio), np.asarray(o.frac) * c.calls * c.recompute_ms) if o is not None
                    else (np.array([1.0]), np.array([c.cost(1.0)])))
    binding = np.nonzero(P.ev_base + Y.sum(1) + P.surge_top() > budget)[0]
    m, col = MilpModel(), {}
    for c in P.candidates:
        ids = [m.add_col(f"x{c.slot}_{k}", 0, 1, True, float(q)) for k, q in enumerate(opts[c.slot][1])]
        col.update({(c.slot, k): j for k, j in enumerate(ids)})
        m.add_row(f"one{c.slot}", ids, [1.0] * len(ids), ub=1.0)
        p = c.parent_slot
        while nesting and p >= 0:  # a candidate and any candidate ancestor: at most one checkpointed
            both = ids + [col[(p, k)] for k in range(len(opts[p][0]))]
            m.add_row(f"nest{c.slot}_{p}", both, [1.0] * len(both), ub=1.0)
            p = P.candidates[p].parent_slot
    for e in binding:
        ind, val = [], []
        for c in P.candidates:
            for k, r in enumerate(opts[c.slot][0]):
                v = C[e, c.slot] * r - Y[e, c.slot] - (P.surge(c.slot)[k] if P.ev_surge[e] == c.slot else 0)
                if v:
                    ind.append(col[(c.slot, k)])
                    val.append(v / GiB)
        m.add_row(f"e{e}", ind, val, lb=(P.ev_base[e] - budget) / GiB)
    return m, col, len(binding)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=60.0, help="s per solve (default 60)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    tree = ModuleTree(sacplan.collect("llama-1b", device="h100", dtype=torch.bfloat16, batch=3, seq=8192))
    budget = parse_budget("80%", tree.stats.device.memory_bytes)
    print(f"collected in {time.perf_counter() - t0:.1f} s; budget {budget / GiB:.2f} GiB")
    P = SacProblem(tree, exact=True, max_options=16)
    print(f"{P.num_candidates} candidates, {len(P.ev_base)} events")
    why: list[str] = []
    t0 = time.perf_counter()
    dp = solve_tree_dp(SacProblem(tree, exact=True, max_options=16), budget, None, why)
    if dp is None:
        print(f"tree DP: gave up after {time.perf_counter() - t0:.2f} s: {why[0]}")
    else:
        print(f"tree DP: {dp.cost_ms:.4f} ms in {dp.seconds:.2f} s (with option building "
              f"{time.perf_counter() - t0:.2f} s); binding events {list(dp.binding)}; fronts {list(dp.front_sizes)}")
    plans = {}
    for label, dp_on in (("with the tree DP", True), ("MILP alone", False)):
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = plans[label] = solve(tree, budget, options=SolverOptions(time_limit_s=args.time_limit, tree_dp=dp_on))
        print(f"solve, {label}: {plan.status}, {plan.objective_ms:.4f} ms, bound {plan.bound_ms:.4f} ms, "
              f"{time.perf_counter() - t0:.1f} s, proved by {plan.meta['proved_by']}")
    a, b = plans.values()
    print(f"plans byte-identical: {a.decisions == b.decisions and a.predicted_peak_bytes == b.predicted_peak_bytes}")
    for nesting in (False, True):
        m, col, n_binding = flat_model(P, budget, nesting)
        t0 = time.perf_counter()
        res = solve_model(m, "highs", gap_rel=1e-6, gap_abs=1e-9, time_limit_s=args.time_limit)
        y, r = np.zeros(P.num_candidates), np.zeros(P.num_candidates)
        for (s, k), j in col.items():
            if res.x is not None and res.x[j] > 0.5:
                y[s], r[s] = 1.0, float(P.options(s).ratio[k]) if P.options(s) is not None else 1.0
        print(f"flat, {'with' if nesting else 'without'} nesting rows ({n_binding} binding events, "
              f"{m.num_cols} columns, {m.num_rows} rows): {res.status}, {res.objective:.4f} ms in "
              f"{time.perf_counter() - t0:.1f} s; nesting respected: {P.nesting_ok(y)}; "
              f"exact peak {P.peak(y, r) / GiB:.3f} GiB")


if __name__ == "__main__":
    main()
