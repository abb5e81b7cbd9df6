"""Plan quality in measured GPU time (issue 26, item 4): the usual hand-written alternatives against sacplan at the
same predicted peak, as real step times on one GPU.

    python3 benchmarks/cuda_plan_quality.py prepare --target H100    # CPU host: fake steps, plans, predictions
    python3 benchmarks/cuda_plan_quality.py measure                  # GPU host: interleaved timed steps

``prepare`` collects each case of ``benchmarks/cuda_validation.py`` on fakes for the target, builds the
alternatives of :mod:`sacplan.alternatives` (full AC of every block, every other block, torchtitan's op list)
and, for each, the sacplan plan at the alternative's own predicted peak; every plan is saved to ``--plans``.
``measure`` builds each case once on the GPU and records each variant's ``torch.cuda.max_memory_allocated`` (no
plan, each alternative, its sacplan plan; forward + backward, no optimizer step, so below the predictions, which
include the optimizer's state and step), then times forward + backward (CUDA events) of one model copy per
variant, each planned once, in interleaved rounds (median and spread of ``--rounds``). The table shows, per alternative, the
predicted recompute ms (sacplan's roofline for the target) and the measured extra ms over no plan.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from cuda_validation import CASES  # noqa: E402  (the benchmark's cases, one definition)
from sac_mode_overhead import built_case, step_timer  # noqa: E402

MiB = 2**20
ALTERNATIVES = ("full_ac_plan", "every_other_block_plan", "torchtitan_op_sac_plan")


def prepare(args: argparse.Namespace) -> None:
    """Alternatives and sacplan at their predicted peaks, saved as plan files with an index."""
    from sacplan import alternatives as alt
    from sacplan.collector import collect
    from sacplan.solver import solve
    from sacplan.testing.torchvision_cpu import declare_torchvision_schemas
    from sacplan.tree import ModuleTree
    from sacplan.units import Bytes

    keep = declare_torchvision_schemas()  # noqa: F841  (kept alive: transformers imports torchvision)
    out = Path(args.plans)
    out.mkdir(parents=True, exist_ok=True)
    index: list[dict[str, Any]] = []
    for name in args.cases:
        case = CASES[name]()
        torch.manual_seed(0)
        stats = collect(case["build"], case["inputs"](), device=args.target, loss_fn=case["loss"], dtype=case["dtype"])
        tree = ModuleTree(stats)
        blocks = alt.find_blocks(tree)
        for make in ALTERNATIVES:
            plan = getattr(alt, make)(tree, blocks)
            ours = solve(tree, Bytes(plan.predicted_peak_bytes), time_limit_s=60)
            stem = f"{name}.{make.removesuffix('_plan')}"
            plan.save(out / f"{stem}.json")
            ours.save(out / f"{stem}.sacplan.json")
            row = {"case": name, "alternative": make.removesuffix("_plan"), "file": f"{stem}.json", "sacplan": f"{stem}.sacplan.json",
                   "alt_peak": plan.predicted_peak_bytes, "alt_recompute_ms": plan.recompute_ms, "sacplan_peak": ours.predicted_peak_bytes,
                   "sacplan_recompute_ms": ours.recompute_ms, "no_plan_peak": stats.peak_bytes, "step_ms": stats.step_ms,
                   # estimated extra step time: recomputation plus the selective mode's dispatch (sacplan.sacmode)
                   "alt_extra_ms": plan.extra_ms, "sacplan_extra_ms": ours.extra_ms}
            index.append(row)
            print(f"{name:9s} {row['alternative']:22s} peak {plan.predicted_peak_bytes / MiB:9.1f} MiB rc {plan.recompute_ms:7.2f} ms "
                  f"extra {row['alt_extra_ms']:7.2f} ms | sacplan {ours.predicted_peak_bytes / MiB:9.1f} MiB rc "
                  f"{ours.recompute_ms:7.2f} ms extra {ours.extra_ms:7.2f} ms", flush=True)
    (out / "index.json").write_text(json.dumps(index, indent=1))


def _variants(name: str, rows: list[dict], plans: Path) -> dict[str, Any]:
    from sacplan.plan import load_plan

    out: dict[str, Any] = {"none": None}
    for r in rows:
        if r["case"] == name:
            out[r["alternative"]] = load_plan(plans / r["file"])
            out[r["alternative"] + " -> sacplan"] = load_plan(plans / r["sacplan"])
    return out


def measure_case(name: str, rows: list[dict], plans: Path, rounds: int, dev: torch.device) -> dict[str, tuple[float, float, float, int]]:
    """Per variant: (median ms, min ms, max ms, peak bytes; 0 off CUDA) of forward + backward on ``dev``."""
    from sacplan.apply import apply_plan, remove_plan
    from sacplan.collector.calling import call_model

    variants = _variants(name, rows, plans)
    model, args, loss = built_case(name, dev)

    def step(m: torch.nn.Module) -> None:
        loss(call_model(m, args), args).backward()
        m.zero_grad(set_to_none=True)

    peaks: dict[str, int] = {}
    for v, plan in variants.items():  # one model: two steps (warm-up; a region's first call), then the measured peak
        remove_plan(model)
        if plan is not None:
            apply_plan(model, plan)
        step(model)
        step(model)
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        step(model)
        peaks[v] = torch.cuda.max_memory_allocated() if dev.type == "cuda" else 0
    remove_plan(model)
    # Timing: one copy of the model per variant, each planned once (as a user applies a plan once: a region planned
    # without RNG state runs its first call under the selective policy, plain afterwards), two warm-up steps each.
    copies = {v: copy.deepcopy(model) for v in variants}
    for v, plan in variants.items():
        if plan is not None:
            apply_plan(copies[v], plan)
        step(copies[v])
        step(copies[v])
    timed, times = step_timer(dev), {v: [] for v in variants}
    for _ in range(rounds):
        for v, m in copies.items():
            times[v].append(timed(lambda: step(m)))
    return {v: (statistics.median(t), min(t), max(t), peaks[v]) for v, t in times.items()}


def measure(args: argparse.Namespace) -> None:
    plans = Path(args.plans)
    rows = json.loads((plans / "index.json").read_text())
    dev = torch.device(args.device)
    print(f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}  torch {torch.__version__}", flush=True)
    for name in dict.fromkeys(r["case"] for r in rows):
        t0 = time.perf_counter()
        try:
            res = measure_case(name, rows, plans, args.rounds, dev)
        except Exception as e:  # keep measuring the other cases
            print(f"{name}: {type(e).__name__}: {e}"[:300], flush=True)
            continue
        base = res["none"][0]
        print(f"\n{name} ({time.perf_counter() - t0:.0f} s; no plan {base:.1f} ms, peak {res['none'][3] / MiB:.0f} MiB)")
        print(f"{'variant':<38} {'pred rc ms':>10} {'pred extra':>10} {'meas extra ms':>13} {'spread ms':>13} {'peak MiB':>9}")
        for r in (r for r in rows if r["case"] == name):
            for v, who in ((r["alternative"], "alt"), (r["alternative"] + " -> sacplan", "sacplan")):
                med, lo, hi, peak = res[v]
                rc, ex = r[f"{who}_recompute_ms"], r.get(f"{who}_extra_ms", r[f"{who}_recompute_ms"])
                print(f"{v:<38} {rc:>10.1f} {ex:>10.1f} {med - base:>+13.1f} {lo - base:>+6.1f}..{hi - base:<+6.1f} "
                      f"{peak / MiB:>9.0f}")
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd in ("prepare", "measure"):
        p = sub.add_parser(cmd)
        p.add_argument("--plans", default=str(HERE / "cuda_quality_plans"))
    sub.choices["prepare"].add_argument("--cases", nargs="+", default=["llama-1b", "gpt2", "vit-b16"], choices=list(CASES))
    sub.choices["prepare"].add_argument("--target", default="H100")
    sub.choices["measure"].add_argument("--rounds", type=int, default=7)
    sub.choices["measure"].add_argument("--device", default="cuda", help="cpu: a smoke run (with plans prepared for --target CPU)")
    args = ap.parse_args()
    (prepare if args.cmd == "prepare" else measure)(args)


if __name__ == "__main__":
    main()
