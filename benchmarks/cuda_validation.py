"""Plans made on a CPU-only host for a named GPU, then proven on that GPU (issue brief: "validate on real CUDA").

Two stages, run on two machines:

    python3 benchmarks/cuda_validation.py prepare --target H100       # CPU host: fake steps, solve, save plans
    python3 benchmarks/cuda_validation.py measure                     # GPU host: real steps with each plan

``prepare`` collects every case on fake tensors for the target spec, solves at two budgets (midway between
the minimum feasible budget and the no-plan peak, and 5% of that gap above the minimum) and writes each plan
with its prediction to ``--plans`` (JSON, small enough to commit). ``measure`` runs :func:`sacplan.validate`
on the GPU for every saved plan: real steps without and with the plan, ``torch.cuda.max_memory_allocated``
against the prediction re-made for the GPU present *and* the CPU host's prediction for its target, CUDA-event
step time against the roofline estimate, recomputed FLOPs, gradients. It also measures what a CUDA process
holds beyond the tensors (cuBLAS workspace), since that is in ``max_memory_allocated``. Each row is appended
to ``--jsonl`` as soon as it is measured, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
MiB = 2**20


# ----------------------------------------------------------------------------------------------- cases
def _labels(n: int, classes: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device) % classes


def _xent(classes: int) -> Callable[[Any, Any], torch.Tensor]:
    def loss(out: Any, inputs: Any) -> torch.Tensor:
        return nn.functional.cross_entropy(out.float(), _labels(out.shape[0], classes, out.device))

    return loss


def _images(batch: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(0)).to(dtype)


def _hf_loss(out: Any) -> torch.Tensor:
    return out.loss


def _llama_1b() -> dict[str, Any]:
    from sacplan.models import get_model

    p = get_model("llama-1b")
    return dict(build=p.build, inputs=lambda: p.example_inputs(2, 2048), loss=p.loss_fn, dtype=torch.bfloat16,
                shape="batch 2, seq 2048, bf16")


def _gpt2() -> dict[str, Any]:
    def build() -> nn.Module:
        import transformers

        cfg = transformers.GPT2Config()  # 124M, dropout 0.1 (fused attention with dropout on CUDA)
        cfg._attn_implementation = "sdpa"
        return transformers.GPT2LMHeadModel(cfg)

    def inputs() -> dict:
        ids = torch.randint(0, 50257, (8, 1024), generator=torch.Generator().manual_seed(0))
        return {"input_ids": ids, "labels": ids}

    return dict(build=build, inputs=inputs, loss=_hf_loss, dtype=torch.bfloat16, shape="batch 8, seq 1024, bf16")


def _vit_b16() -> dict[str, Any]:
    def build() -> nn.Module:
        import timm

        return timm.create_model("vit_base_patch16_224", pretrained=False)

    return dict(build=build, inputs=lambda: (_images(64, torch.bfloat16),), loss=_xent(1000), dtype=torch.bfloat16, shape="batch 64, 224x224, bf16")


def _resnet50() -> dict[str, Any]:
    def build() -> nn.Module:
        import torchvision

        return torchvision.models.resnet50()

    return dict(build=build, inputs=lambda: (_images(64, torch.float32),), loss=_xent(1000), dtype=None, shape="batch 64, 224x224, fp32")


def _llama_small() -> dict[str, Any]:  # a smoke case: seconds on a CPU (``measure --device cpu``)
    from sacplan.models import get_model

    p = get_model("llama-small")
    return dict(build=p.build, inputs=lambda: p.example_inputs(8, 256), loss=p.loss_fn, dtype=None, shape="batch 8, seq 256")


CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "llama-small": _llama_small,
    "llama-1b": _llama_1b,
    "gpt2": _gpt2,
    "vit-b16": _vit_b16,
    "resnet50": _resnet50,
}


# --------------------------------------------------------------------------------------------- prepare
def prepare(args: argparse.Namespace) -> None:
    """Fake steps for ``args.target``, two plans per case, saved with their predictions."""
    from sacplan.collector import collect
    from sacplan.solver import min_feasible_budget, solve
    from sacplan.tree import ModuleTree
    from sacplan.units import Bytes

    from sacplan.testing.torchvision_cpu import declare_torchvision_schemas

    keep = declare_torchvision_schemas()  # noqa: F841  (kept alive:) the CPU torch wheel cannot load torchvision's compiled ops (transformers imports it)
    out = Path(args.plans)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.cases:
        case = CASES[name]()
        t0 = time.perf_counter()
        torch.manual_seed(0)
        stats = collect(case["build"], case["inputs"](), device=args.target, loss_fn=case["loss"], dtype=case["dtype"])
        tree = ModuleTree(stats)
        lo = int(min_feasible_budget(tree, time_limit_s=60))
        hi = int(stats.peak_bytes)
        t1 = time.perf_counter()
        for label, budget in (("mid", (lo + hi) // 2), ("tight", lo + (hi - lo) // 20)):
            plan = solve(tree, Bytes(budget), time_limit_s=60)
            plan.save(out / f"{name}.{label}.json")
            print(f"{name:9s} {label:5s} no-plan {hi / MiB:9.1f} MiB  min {lo / MiB:9.1f}  budget {budget / MiB:9.1f}  "
                  f"predicted {plan.predicted_peak_bytes / MiB:9.1f}  recompute {plan.recompute_ms:7.2f} ms  "
                  f"step {stats.step_ms:7.2f} ms  ({case['shape']}; collect+min {t1 - t0:.0f} s)", flush=True)


# --------------------------------------------------------------------------------------------- measure
def cuda_overhead() -> dict[str, int]:
    """Bytes ``torch.cuda.memory_allocated`` counts beyond tensors after the first bf16 / fp32 matmuls."""
    before = torch.cuda.memory_allocated()
    a = torch.randn(256, 256, device="cuda")
    b = a.bfloat16()
    live = a.untyped_storage().nbytes() + b.untyped_storage().nbytes()
    (a @ a).sum().item()
    (b @ b).sum().item()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    out = {"before": before, "after_matmuls_minus_tensors": after - before - live}
    del a, b
    return out


def measure(args: argparse.Namespace) -> None:
    from sacplan.errors import PlanMismatchError
    from sacplan.plan import load_plan

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("measure needs a CUDA device (--device cpu for a smoke run)")
    dev_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    overhead = cuda_overhead() if args.device == "cuda" else {}
    print(f"{dev_name}  torch {torch.__version__}  overhead {overhead}", flush=True)
    sink = open(args.jsonl, "a") if args.jsonl else None
    for name in args.cases:
        case = CASES[name]()
        for label in ("mid", "tight"):
            path = Path(args.plans) / f"{name}.{label}.json"
            if not path.exists():
                continue
            plan = load_plan(path)
            t0 = time.perf_counter()
            try:
                try:
                    r = _validate(case, plan, args)
                except PlanMismatchError as e:  # the GPU host's library version names modules differently
                    print(f"{name} {label}: {e}\n  re-planning on this host at the same budget", flush=True)
                    plan = _replan(case, plan.budget_bytes, args.device)
                    r = _validate(case, plan, args)
            except Exception as e:  # keep measuring the other cases
                traceback.print_exc()
                row = {"case": name, "budget": label, "error": f"{type(e).__name__}: {e}"[:500]}
            else:
                print(f"--- {name} {label} ({case['shape']}), {time.perf_counter() - t0:.0f} s\n{r.summary()}", flush=True)
                row = _row(name, label, case, plan, r, dev_name)
            if sink:
                sink.write(json.dumps(row) + "\n")
                sink.flush()
            torch.cuda.empty_cache()


def _validate(case: dict, plan: Any, args: argparse.Namespace) -> Any:
    from sacplan.validation import validate

    return validate(case["build"], case["inputs"], plan, loss_fn=case["loss"], dtype=case["dtype"], device=args.device,
                    timed_steps=args.timed_steps, grad_rtol=1e-2, grad_atol=1e-3, compile=args.compile)


def _replan(case: dict, budget: int, device: str) -> Any:
    """A plan for this host's own spec at ``budget`` bytes (when the saved plan's fingerprint does not match)."""
    from sacplan.collector import collect
    from sacplan.devices import CPU, DeviceSpec
    from sacplan.solver import solve
    from sacplan.tree import ModuleTree
    from sacplan.units import Bytes

    spec = DeviceSpec.from_current_cuda() if device == "cuda" else CPU
    torch.manual_seed(0)
    stats = collect(case["build"], case["inputs"](), device=spec, loss_fn=case["loss"], dtype=case["dtype"])
    return solve(ModuleTree(stats), Bytes(budget), time_limit_s=60)


def _row(name: str, label: str, case: dict, plan: Any, r: Any, dev_name: str) -> dict[str, Any]:
    return {
        "case": name, "budget": label, "shape": case["shape"], "gpu": dev_name, "torch": torch.__version__,
        "plan_target": plan.device_name, "budget_bytes": plan.budget_bytes,
        "plan_predicted_peak": plan.predicted_peak_bytes, "plan_predicted_baseline_peak": plan.baseline_peak_bytes,
        "host_predicted_peak": r.predicted_peak_bytes, "host_predicted_baseline_peak": r.predicted_baseline_peak_bytes,
        "measured_baseline_peak": r.baseline.peak_bytes, "measured_peak": r.planned.peak_bytes,
        "predicted_recompute_flops": r.predicted_recompute_flops, "measured_recompute_flops": r.measured_recompute_flops,
        "predicted_baseline_step_ms": r.predicted_baseline_step_ms, "predicted_step_ms": r.predicted_step_ms,
        "plan_recompute_ms": plan.recompute_ms, "plan_baseline_step_ms": plan.baseline_step_ms,
        "plan_dispatch_ms": getattr(plan, "dispatch_ms", 0.0), "host_dispatch_ms": r.predicted_dispatch_ms,
        "measured_baseline_step_ms": r.baseline.step_ms, "measured_step_ms": r.planned.step_ms,
        "compiled": r.compiled, "grads_bitwise": r.grads_bitwise_equal, "grads_match": r.grads_match, "max_grad_diff": r.max_grad_abs_diff,
    }


# ---------------------------------------------------------------------------------------------- report
def report(args: argparse.Namespace) -> None:
    """A Markdown table of a ``measure`` JSONL (errors: measured − predicted, over measured)."""
    rows = [json.loads(line) for line in open(args.jsonl)]
    print("| case | budget | no plan: pred (GPU) / meas MiB | err | plan: pred (GPU) / pred (CPU host, target) / meas MiB "
          "| err | recompute GFLOP pred / meas | step ms no plan: est / meas | step ms plan: est / meas | grads |")
    print("|" + "---|" * 10)
    for d in rows:
        if "error" in d:
            print(f"| {d['case']} | {d['budget']} | {d['error'][:120]} |" + " |" * 7)
            continue
        e0 = (d["measured_baseline_peak"] - d["host_predicted_baseline_peak"]) / d["measured_baseline_peak"]
        e1 = (d["measured_peak"] - d["host_predicted_peak"]) / d["measured_peak"]
        mf = d["measured_recompute_flops"]
        print(
            f"| {d['case']} ({d['shape']}{', compiled ' + d['compiled'] if d.get('compiled') else ''}) | {d['budget']} {d['budget_bytes'] / MiB:.0f} MiB "
            f"| {d['host_predicted_baseline_peak'] / MiB:.1f} / {d['measured_baseline_peak'] / MiB:.1f} | {e0:+.2%} "
            f"| {d['host_predicted_peak'] / MiB:.1f} / {d['plan_predicted_peak'] / MiB:.1f} ({d['plan_target']}) / "
            f"{d['measured_peak'] / MiB:.1f} | {e1:+.2%} "
            f"| {d['predicted_recompute_flops'] / 1e9:.2f} / {(mf or 0) / 1e9:.2f} "
            f"| {_ms(d['predicted_baseline_step_ms'])} / {d['measured_baseline_step_ms']:.1f} "
            f"| {_ms(d['predicted_step_ms'])} / {d['measured_step_ms']:.1f} "
            f"| {'bitwise' if d['grads_bitwise'] else ('close' if d['grads_match'] else 'DIFFER')} {d['max_grad_diff']:.2g} |"
        )


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="stage", required=True)
    for stage in ("prepare", "measure", "report"):
        p = sub.add_parser(stage)
        p.add_argument("--cases", nargs="+", default=[c for c in CASES if c != "llama-small"], choices=list(CASES))
        p.add_argument("--plans", default=str(HERE / "cuda_plans"))
        p.add_argument("--jsonl", default=os.path.join(os.environ.get("OUT", "."), "cuda_validation.jsonl"))
    sub.choices["prepare"].add_argument("--target", default="H100")
    sub.choices["measure"].add_argument("--timed-steps", type=int, default=5)
    sub.choices["measure"].add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    sub.choices["measure"].add_argument("--compile", action="store_true", help="compiled steps (Inductor, per block)")
    args = ap.parse_args()
    {"prepare": prepare, "measure": measure, "report": report}[args.stage](args)


if __name__ == "__main__":
    main()
