"""Plan selective activation checkpointing for a small Llama, apply it, and train a few steps.

    python examples/train_loop.py                       # llama-small, plan for the host CPU, 3 steps
    python examples/train_loop.py --model llama-tiny --target h100 --budget-frac 0.5

The plan is made on fake tensors for ``--target`` (``cpu``: exact host sizes, so the plan describes this
very run; ``h100``: what the step would need on an H100), with the budget placed ``--budget-frac`` of the
way from the minimum feasible budget to the no-checkpointing peak. The real model then trains with the
plan applied (``apply_plan`` wraps the chosen modules in ``torch.utils.checkpoint`` with an op-level
selective policy); gradients are unchanged, only memory and recompute differ.
"""

from __future__ import annotations

import argparse
import time

import torch

from sacplan.apply import apply_plan
from sacplan.collector import collect
from sacplan.models import get_model
from sacplan.solver import baseline_peak, min_feasible_budget, solve
from sacplan.tree import ModuleTree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-small", help="a small Llama preset (default llama-small)")
    ap.add_argument("--target", default="cpu", help="device to plan for: cpu (this host) or a GPU name")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget-frac", type=float, default=0.5, help="0 = minimum feasible, 1 = no-AC peak")
    args = ap.parse_args()

    preset = get_model(args.model)

    # 1. plan on fake tensors (no memory is allocated for the model here)
    t0 = time.perf_counter()
    stats = collect(preset.name, device=args.target, batch=args.batch, seq=args.seq)
    tree = ModuleTree(stats)
    lo, hi = min_feasible_budget(tree), baseline_peak(tree)
    budget = int(lo + args.budget_frac * (hi - lo))
    plan = solve(tree, f"{budget}B")
    print(plan.summary())
    print(f"planned in {time.perf_counter() - t0:.1f} s")

    # 2. an ordinary PyTorch training loop with the plan applied
    torch.manual_seed(0)
    model = preset.build()
    apply_plan(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs = preset.example_inputs(args.batch, args.seq)
    model.train()
    for step in range(args.steps):
        loss = preset.loss_fn(model(*inputs), inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {step}: loss {loss.item():.4f}")
    print(f"trained {args.steps} steps with {len(plan.decisions)} checkpointed modules")


if __name__ == "__main__":
    main()
