"""Train a torchtitan-style Llama with FSDP2 x tensor parallel and a sacplan plan, on 4 CPU ranks (gloo).

    python examples/train_2d_llama.py                       # dp_shard 2 x tp 2, bf16 mixed precision, 3 steps
    python examples/train_2d_llama.py --tp 2 --dp-shard 1 --steps 5

1. Plan (one process, no GPU, no peers): ``sacplan.collect(..., mesh={"dp_shard": 2, "tp": 2},
   parallelize=parallelize)`` runs *the same parallelize function the job uses* on PyTorch's fake process
   group and records rank 0's step (DTensor local shards, FSDP2's all-gathers and mixed precision, the TP
   collectives); ``solve`` plans that rank under ``--budget-fraction`` of the way from the minimum feasible
   budget to the no-checkpointing peak. Every rank gets the same plan.
2. Train: ``--dp-shard x --tp`` spawned ranks join a gloo group (FileStore rendezvous), build the model and
   call ``parallelize(model, mesh, plan)``: the plan is applied inside the parallelize function, where
   torchtitan calls its activation checkpointing (``ac_config.build(...).apply(model)``).

Each rank prints its loss and the per-rank peak its first step measured (sacplan's StepRecorder) next to
the predicted one.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

from sacplan.apply import apply_plan
from sacplan.models import get_model
from sacplan.models.llama_parallel import parallelize_llama

PRESET = get_model("llama-tiny")


def policy(mixed: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None


def parallelize(model, mesh, plan=None, *, mixed: bool = True):
    """The job's parallelize function: sacplan's plan where torchtitan applies AC, then TP + FSDP2."""
    if plan is not None:
        apply_plan(model, plan)  # instead of torchtitan's ac_config.build(...).apply(model)
    return parallelize_llama(model, mesh, mp_policy=policy(mixed))


def tokens(dp_rank: int, batch: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(dp_rank)
    return torch.randint(0, PRESET.config.vocab_size, (batch, seq), generator=g)


def make_plan(args):
    from sacplan import collect, solve
    from sacplan.solver import baseline_peak, min_feasible_budget
    from sacplan.tree import ModuleTree

    stats = collect(lambda: PRESET.build(n_layers=args.layers), tokens(0, args.batch, args.seq), device="cpu",
                    loss_fn=PRESET.loss_fn, mesh={"dp_shard": args.dp_shard, "tp": args.tp},
                    parallelize=lambda m, mesh: parallelize(m, mesh, mixed=args.mixed))
    tree = ModuleTree(stats)  # its FSDP units (never checkpointed around) are what fully_shard was called on
    lo, hi = min_feasible_budget(tree), baseline_peak(tree)
    return solve(tree, int(lo + args.budget_fraction * (hi - lo)))


def rank_main(rank: int, args, plan_dict: dict, rdzv: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from sacplan.plan import Plan
    from sacplan.validation import tracker_step_peak

    torch.set_num_threads(1)
    world = args.dp_shard * args.tp
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (args.dp_shard, args.tp), mesh_dim_names=("dp_shard", "tp"))
        plan = Plan.from_dict(plan_dict)
        torch.manual_seed(0)
        model = parallelize(PRESET.build(n_layers=args.layers), mesh, plan, mixed=args.mixed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        toks = tokens(mesh.get_local_rank("dp_shard"), args.batch, args.seq)
        for step in range(args.steps):
            loss = PRESET.loss_fn(model(toks), toks)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if rank == 0:
                print(f"step {step}: loss {loss.item():.4f}", flush=True)

        def one_step() -> None:
            out = PRESET.loss_fn(model(toks), toks)
            out.backward()
            del out
            opt.step()
            opt.zero_grad(set_to_none=True)

        peak = tracker_step_peak(model, (toks,), one_step, opt)
        print(f"rank {rank}: measured peak {peak / 2**20:.3f} MiB, predicted {plan.predicted_peak_bytes / 2**20:.3f} MiB",
              flush=True)
    finally:
        dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp-shard", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2, help="per data-parallel rank")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget-fraction", type=float, default=0.5)
    ap.add_argument("--fp32", dest="mixed", action="store_false", help="no mixed precision")
    args = ap.parse_args()
    plan = make_plan(args)
    print(plan.summary() if hasattr(plan, "summary") else plan, flush=True)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(rank_main, args=(args, plan.to_dict(), str(Path(d) / "rdzv")), nprocs=args.dp_shard * args.tp)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    raise SystemExit(main())
