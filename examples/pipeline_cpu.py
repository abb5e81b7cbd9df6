"""Train a 2-stage pipeline (1F1B) on CPU with a selective-checkpointing plan per stage.

    python examples/pipeline_cpu.py                   # llama-small split in 2 stages, 4 microbatches, 3 steps
    python examples/pipeline_cpu.py --schedule gpipe --steps 5 --budget-frac 0.3

1. Plan on fake tensors: ``collect_pipeline`` runs each rank's ``torch.distributed.pipelining`` schedule under a fake
   process group (no memory, no second process), ``solve_pipeline`` plans each rank for its own budget (the first
   stage holds more microbatches in flight under 1F1B, so it needs a different plan), and one file holds them all.
2. Train for real: two gloo processes, each builds its stage, applies its part of the plan file
   (``apply_plan(stage, plan, stage=rank)``), wraps it in a ``PipelineStage`` and steps the schedule.
3. ``--validate``: measure each rank's peak without and with the plan against the prediction.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import sacplan
from sacplan.models import get_model
from sacplan.pipeline import collect_pipeline, solve_pipeline, validate_pipeline
from sacplan.pipeline.presets import preset_pipeline
from sacplan.solver import min_feasible_budget
from sacplan.units import Bytes, fmt_bytes

RANKS = 2
SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


def train(rank: int, args: argparse.Namespace, plan_path: str, rdzv: str) -> None:
    """One pipeline rank: its stage with its part of the plan, trained for ``args.steps`` steps."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=RANKS)
    stage_fns, tokens, loss_fn = preset_pipeline(get_model(args.model), RANKS, batch=args.batch, seq=args.seq, dtype=None)
    torch.manual_seed(0)
    stage = stage_fns[rank]()  # token ids -> hidden states on rank 0, hidden states -> logits on rank 1
    plan = sacplan.load_plan(plan_path)  # every stage's plan, one file
    sacplan.apply_plan(stage, plan, stage=rank)  # this stage's part, checked against the module
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-3)
    sched = SCHEDULES[args.schedule](PipelineStage(stage, rank, RANKS, torch.device("cpu")), args.microbatches,
                                     loss_fn=loss_fn)
    for step in range(args.steps):
        losses: list[torch.Tensor] = []
        if rank == 0:
            sched.step(tokens)
        else:
            sched.step(target=tokens, losses=losses)
            print(f"step {step}: loss {torch.stack(losses).mean().item():.4f}", flush=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-small", help="a Llama preset, split in two stages (default llama-small)")
    ap.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget-frac", type=float, default=0.5, help="0 = minimum feasible, 1 = no-checkpointing peak")
    ap.add_argument("--validate", action="store_true", help="measure each rank's peak without and with the plan")
    args = ap.parse_args()

    # 1. plan every stage on fake tensors, for this CPU
    stage_fns, tokens, loss_fn = preset_pipeline(get_model(args.model), RANKS, batch=args.batch, seq=args.seq, dtype=None)
    stats = collect_pipeline(stage_fns, tokens, schedule=args.schedule, microbatches=args.microbatches,
                             loss_fn=loss_fn, target=tokens, device="cpu")
    budgets = []
    for s in stats:  # each rank's own budget, the same fraction of the way from its minimum to its peak
        lo = min_feasible_budget(sacplan.ModuleTree(s))
        budgets.append(Bytes(int(lo + args.budget_frac * (s.peak_bytes - lo))))
    plan = solve_pipeline(stats, budgets)
    print(plan.summary())
    with tempfile.TemporaryDirectory() as tmp:
        path = str(plan.save(Path(tmp) / "pipeline_plan.json"))

        # 2. train: one process per pipeline rank
        mp.spawn(train, args=(args, path, str(Path(tmp) / "rdzv")), nprocs=RANKS, join=True)

    # 3. prove the prediction on this host's real steps
    if args.validate:
        for r in validate_pipeline(stage_fns, tokens, stats, plan, loss_fn=loss_fn, target=tokens):
            print(f"rank {r.rank}: peak without plan {fmt_bytes(r.measured_baseline)} (predicted {r.baseline_error:+.2%} "
                  f"off), with plan {fmt_bytes(r.measured_plan)} ({r.plan_error:+.2%} off); gradients bitwise equal: "
                  f"{r.grads_equal}")
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort interpreter teardown after the work is done (tests/distributed/_mp.py)


if __name__ == "__main__":
    main()
