"""Predicted vs measured peak memory, recompute FLOPs and step time for the built-in models at several budgets.

    python3 benchmarks/validate_accuracy.py [--device cpu|cuda] [--fracs 0.9 0.75 0.6]

On CPU the measurement is torch.profiler's allocator events (plus bytes live at step start), cross-checked
with sacplan's tracker on the real tensors; on CUDA it is torch.cuda.max_memory_allocated, and the step time
is also compared with the roofline estimate for the GPU present. Plans are solved on stats collected for the
measuring host's own spec, so the comparison tests the memory model, not a device mismatch.
"""

from __future__ import annotations

import argparse

import torch

from sacplan.collector import collect
from sacplan.devices import CPU, DeviceSpec
from sacplan.errors import InfeasibleBudgetError
from sacplan.models import get_model
from sacplan.solver import solve
from sacplan.tree import ModuleTree
from sacplan.validation import validate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--fracs", type=float, nargs="+", default=[0.9, 0.8, 0.7])
    ap.add_argument("--models", nargs="+", default=["llama-tiny:4:128", "llama-small:2:256", "cnn-tiny:16"])
    args = ap.parse_args()
    spec = CPU if args.device == "cpu" else DeviceSpec.from_current_cuda()
    print(f"host {args.device}  spec {spec.name}")
    print(f"{'model':16s} {'budget':>7s} {'pred peak MiB':>13s} {'meas peak MiB':>13s} {'err':>7s} "
          f"{'pred rc GFLOP':>13s} {'meas rc GFLOP':>13s} {'step ms base':>12s} {'step ms plan':>12s} grads")
    for entry in args.models:
        name, *sizes = entry.split(":")
        preset = get_model(name)
        batch = int(sizes[0]) if sizes else preset.default_batch
        seq = int(sizes[1]) if len(sizes) > 1 else None
        model_fn = lambda: preset.build()  # noqa: E731
        inputs_fn = lambda: preset.example_inputs(batch, seq)  # noqa: E731
        torch.manual_seed(0)
        stats = collect(model_fn, inputs_fn(), device=spec, loss_fn=preset.loss_fn)
        tree = ModuleTree(stats)
        for frac in args.fracs:
            try:
                plan = solve(tree, int(stats.peak_bytes * frac))
            except InfeasibleBudgetError as e:
                print(f"{entry:16s} {frac:7.0%}  infeasible (minimum feasible {e.min_feasible_bytes / 2**20:.2f} MiB)")
                continue
            r = validate(model_fn, inputs_fn, plan, loss_fn=preset.loss_fn, device=args.device)
            print(
                f"{entry:16s} {frac:7.0%} {r.predicted_peak_bytes / 2**20:13.2f} {r.planned.peak_bytes / 2**20:13.2f} "
                f"{r.peak_error:+7.2%} {r.predicted_recompute_flops / 1e9:13.4f} {r.measured_recompute_flops / 1e9:13.4f} "
                f"{r.baseline.step_ms:12.2f} {r.planned.step_ms:12.2f} {'bitwise' if r.grads_bitwise_equal else ('close' if r.grads_match else 'DIFFER')}"
            )


if __name__ == "__main__":
    main()
