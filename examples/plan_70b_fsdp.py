"""Plan SAC for Llama 3 70B trained with FSDP on 8 x H100, 75 GiB per GPU.

    python examples/plan_70b_fsdp.py                    # 80 layers, batch 1, seq 8192
    python examples/plan_70b_fsdp.py --layers 8 --seq 4096

Parameters, gradients and AdamW state are sharded over ``--world-size`` ranks (FSDP); activations are
per rank. Collection runs one fake training step on the host (nothing is allocated), so all 80 layers
are collected by default; ``--layers N`` plans a shallower model of the same width when you want it faster.
The default budget is 75 GiB per GPU: an "80GB" H100 has 79.19 GiB usable, and the CUDA context, NCCL's
buffers and the caching allocator's fragmentation need a few GiB of it that no step profile shows, so
plan below the card (a budget above it is accepted with a BudgetWarning, and the plan would not fit). At
batch 1 x 8192 tokens on 8 ranks the minimum feasible budget is 71.3 GiB: the sharded parameters,
gradients and AdamW state alone are ~70 GiB per rank, so more ranks (``--world-size 16``) leave more room.
"""

from __future__ import annotations

import argparse
import time

from sacplan.collector import collect
from sacplan.errors import InfeasibleBudgetError
from sacplan.models import get_model
from sacplan.solver import baseline_peak, solve
from sacplan.tree import ModuleTree


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=None, help="override the number of layers (default: all 80)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--budget", default="75GiB", help="per-GPU budget (default 75GiB: headroom below the 79.19 GiB card)")
    ap.add_argument("--device", default="h100")
    args = ap.parse_args()

    import torch

    preset = get_model("llama-70b")
    # FSDP2 steps each rank's *shard* with a foreach AdamW, so the optimizer's temporaries are sharded too.
    # sacplan shards parameters/gradients/optimizer state by world size but counts foreach temporaries
    # at full size, so we model the step with a per-parameter (foreach=False) AdamW: its temporaries are
    # one parameter at a time, close to a sharded foreach step.
    optimizer = lambda ps: torch.optim.AdamW(ps, foreach=False)  # noqa: E731
    t0 = time.perf_counter()
    progress = lambda s: print(f"  [{time.perf_counter() - t0:5.1f} s] {s}", flush=True)  # noqa: E731
    if args.layers is None:
        stats = collect(preset.name, device=args.device, dtype="bf16", batch=args.batch, seq=args.seq,
                        optimizer=optimizer, progress=progress)
    else:
        stats = collect(
            lambda: preset.build(dtype=torch.bfloat16, n_layers=args.layers),
            lambda: preset.example_inputs(args.batch, args.seq),
            device=args.device,
            loss_fn=preset.loss_fn,
            optimizer=optimizer,
            model_name=f"llama-70b ({args.layers} layers)",
            progress=progress,
        )
    tree = ModuleTree(stats)
    print(f"collected {len(tree)} modules in {time.perf_counter() - t0:.1f} s")
    print(f"no-AC peak per GPU: {baseline_peak(tree, world_size=1) / 2**30:.1f} GiB unsharded, "
          f"{baseline_peak(tree, world_size=args.world_size) / 2**30:.1f} GiB with FSDP x{args.world_size}")
    try:
        plan = solve(tree, args.budget, world_size=args.world_size, time_limit_s=45)
    except InfeasibleBudgetError as e:
        print(f"infeasible: minimum feasible budget is {e.min_feasible_bytes / 2**30:.2f} GiB per GPU")
        return 3
    print(plan.summary(extra=[f"batch {args.batch}, seq {args.seq}, bf16, FSDP world size {args.world_size}"]))
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
