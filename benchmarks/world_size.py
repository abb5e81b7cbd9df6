"""Per-rank planning across FSDP2 world sizes for a Llama-70B-shaped model at a fixed per-GPU budget.

One fake step is collected for an H100 (bf16, AdamW foreach, batch 1) on this host; for each world size
:func:`sacplan.distributed.shard_stats` turns it into one rank's stats (FSDP2, each block + root a unit,
exact per-parameter shard shapes from a meta model), and the solver plans per rank:

* ``no-AC peak``: predicted per-rank peak without checkpointing;
* ``min feasible``: :func:`sacplan.solver.min_feasible_budget` (every block as checkpointed as it can be);
* ``plan``: the cheapest plan under the budget (80 GiB), its predicted peak, checkpointed modules and the
  recompute ms it adds per step (H100 roofline), or "infeasible" when ``min feasible`` exceeds the budget.
* ``AG+RS``: the FSDP collective buffers (all-gathered units, prefetch, reduce-scatter) at the peak event.

    python benchmarks/world_size.py                    # 80 layers, seq 8192, world sizes 8 64 512
    python benchmarks/world_size.py --layers 16 --seq 4096 --world-sizes 8 64 512
    python benchmarks/world_size.py --no-highs         # solver's auxiliary LPs on CBC instead of HiGHS
"""

from __future__ import annotations

import argparse
import time

from sacplan.units import GiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--budget-gib", type=float, default=80.0)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--device", default="h100")
    ap.add_argument("--no-highs", action="store_true",
                    help="hide highspy so the solver's auxiliary LPs use CBC (work-around, see the notes it prints)")
    args = ap.parse_args()
    if args.no_highs:
        import sys

        sys.modules["highspy"] = None  # type: ignore[assignment]  # ImportError for `import highspy`

    import torch

    from sacplan.collector import collect
    from sacplan.distributed import shard_stats
    from sacplan.errors import InfeasibleBudgetError, SolverError
    from sacplan.models import get_model
    from sacplan.solver import baseline_peak, min_feasible_budget, solve
    from sacplan.tree import ModuleTree

    preset = get_model("llama-70b")
    t0 = time.perf_counter()
    stats = collect(
        lambda: preset.build(dtype=torch.bfloat16, n_layers=args.layers),
        lambda: preset.example_inputs(batch=args.batch, seq=args.seq),
        device=args.device,
        loss_fn=preset.loss_fn,
        model_name=f"llama-70b ({args.layers} layers)",
    )
    t_collect = time.perf_counter() - t0
    with torch.device("meta"):
        meta_model = preset.build(dtype=torch.bfloat16, n_layers=args.layers)
    budget = int(args.budget_gib * GiB)
    print(
        f"llama-70b shape, {args.layers} layers, batch {args.batch}, seq {args.seq}, bf16, AdamW, {stats.device.name}; "
        f"collect {t_collect:.1f}s; single-rank peak {stats.peak_bytes / GiB:.1f} GiB "
        f"(params {stats.param_bytes / GiB:.1f} GiB); per-GPU budget {args.budget_gib:g} GiB; FSDP2 each block + root"
    )
    head = ("world", "sharded state", "AG+RS", "no-AC peak", "min feasible", "plan peak", "ckpt modules", "recompute ms", "step ms", "solve s")
    rows = [head]
    notes: list[str] = []
    for ws in args.world_sizes:
        t1 = time.perf_counter()
        per_rank = shard_stats(stats, ws, model=meta_model)
        info = per_rank.meta["distributed"]
        tree = ModuleTree(per_rank)
        units = [u for u in info["units"] if u]
        base = baseline_peak(tree)
        lo = min_feasible_budget(tree, fsdp_units=units)
        try:
            plan = solve(tree, budget, fsdp_units=units)
            peak = f"{plan.predicted_peak_bytes / GiB:.1f} GiB"
            ck = str(len(plan.decisions)) + ("" if plan.decisions else " (none needed)")
            rc = f"{plan.recompute_ms:.1f}"
        except InfeasibleBudgetError:
            peak, ck, rc = "infeasible", "-", "-"
        except SolverError as e:  # reported, not hidden: the row says the solver failed
            peak, ck, rc = "solver error", "-", "-"
            notes.append(f"world {ws}: solve(budget) raised SolverError: {e}")
        rows.append((
            str(ws),
            f"{(per_rank.param_bytes + per_rank.optimizer_bytes) / GiB:.2f} GiB",
            f"{(info['allgather_bytes'] + info['reduce_scatter_bytes']) / GiB:.2f} GiB",
            f"{base / GiB:.1f} GiB",
            f"{lo / GiB:.1f} GiB",
            peak,
            ck,
            rc,
            f"{per_rank.step_ms:.0f}",
            f"{time.perf_counter() - t1:.1f}",
        ))
    w = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("  ".join(c.rjust(w[i]) for i, c in enumerate(r)))
    print("sharded state = params + optimizer state per rank (grads add up to the params' size in backward);")
    print("step ms = estimated fw+bw+optimizer without checkpointing (per rank, excluding communication).")
    for n in notes:
        print(n)


if __name__ == "__main__":
    main()
