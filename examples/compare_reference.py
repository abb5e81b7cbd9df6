"""Run sacplan's ``sac_milp`` and PyTorch's reference ``torch.distributed._tools.sac_ilp.sac_milp`` on the same numbers.

    python examples/compare_reference.py                       # llama-small on an H100, 50% of the way
    python examples/compare_reference.py --model llama-tiny --frac 0.3

Both solvers read one collected step: ``tree.to_torch_module_info()`` builds PyTorch's ``ModuleInfo`` dict,
``parse_module_info`` turns it into PyTorch's ``Graph``. sacplan solves its own tree (``sac_milp(tree, ...)``)
and, for a like-for-like check, PyTorch's graph too (``sac_milp(graph, ...)``). Budgets are in GiB, as in PyTorch.
"""

from __future__ import annotations

import argparse
import time

from sacplan.collector import collect
from sacplan.solver import baseline_peak, min_feasible_budget, sac_milp
from sacplan.tree import ModuleTree
from sacplan.units import GiB


def show(name: str, result: tuple, seconds: float) -> None:
    decisions, ms, peak = result
    print(f"{name}: recompute {ms:.3f} ms, peak {peak / GiB:.4f} GiB, {len(decisions)} modules, {seconds:.2f} s")
    for fqn, ratio in sorted(decisions.items()):
        print(f"    {fqn or '<root>':<32} discard {ratio:.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-small")
    ap.add_argument("--device", default="h100")
    ap.add_argument("--frac", type=float, default=0.5, help="budget: 0 = minimum feasible, 1 = no-AC peak")
    args = ap.parse_args()

    from torch.distributed._tools.ilp_utils import parse_module_info
    from torch.distributed._tools.sac_ilp import sac_milp as torch_sac_milp

    tree = ModuleTree(collect(args.model, device=args.device))
    lo, hi = min_feasible_budget(tree), baseline_peak(tree)
    budget_gib = (lo + args.frac * (hi - lo)) / GiB
    print(f"{args.model} on {tree.stats.device.name}: no-AC peak {hi / GiB:.4f} GiB, minimum feasible {lo / GiB:.4f} GiB, "
          f"budget {budget_gib:.4f} GiB")

    graph = parse_module_info(tree.to_torch_module_info())
    t = time.perf_counter()
    ours = sac_milp(tree, budget_gib)
    show("sacplan sac_milp (sacplan tree)", ours, time.perf_counter() - t)
    t = time.perf_counter()
    ours_g = sac_milp(graph, budget_gib)
    show("sacplan sac_milp (PyTorch graph)", ours_g, time.perf_counter() - t)
    t = time.perf_counter()
    ref = torch_sac_milp(graph, budget_gib)
    show("PyTorch sac_milp (PyTorch graph)", ref, time.perf_counter() - t)


if __name__ == "__main__":
    main()
