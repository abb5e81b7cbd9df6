"""Where the roofline's step time misses a real GPU step: per-op estimates of the CUDA validation cases.

Re-collects the cases of ``benchmarks/cuda_validation.py`` on fakes for an H200 spec (the GPU of the recorded run),
records every non-view op's estimated ms, and prints, beside the measured no-plan step of
``benchmarks/cuda_results/run8_final.jsonl``, the step estimated with a per-op floor (``max(op ms, floor)``) for a
few floors: whether one host-side cost per op explains the gap. CPU only, about a minute::

    python3 benchmarks/step_time_gap.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

FLOORS_MS = (0.004, 0.01, 0.015, 0.02, 0.03)


def per_op_ms(case: dict) -> list[float]:
    """Estimated ms of each non-view op of one training step of ``case`` on an H200 (roofline)."""
    from sacplan.collector import collect
    from sacplan.collector import runtime

    seen: list[float] = []
    original = runtime.RuntimeModel.estimate

    def recording(self, func, args, kwargs, out, flops, is_view):  # type: ignore[no-untyped-def]
        ms = original(self, func, args, kwargs, out, flops, is_view)
        if not is_view:
            seen.append(ms)
        return ms

    runtime.RuntimeModel.estimate = recording  # type: ignore[method-assign]
    try:
        torch.manual_seed(0)
        collect(case["build"], case["inputs"](), device="h200", loss_fn=case["loss"], dtype=case["dtype"])
    finally:
        runtime.RuntimeModel.estimate = original  # type: ignore[method-assign]
    return seen


def main() -> None:
    from sacplan.testing.torchvision_cpu import declare_torchvision_schemas

    keep = declare_torchvision_schemas()  # noqa: F841 (torchvision's fake kernels need the schemas)
    import cuda_validation

    measured = {}
    for line in open(HERE / "cuda_results" / "run8_final.jsonl"):
        row = json.loads(line)
        measured.setdefault(row["case"], row["measured_baseline_step_ms"])
    print("| model | ops | " + " | ".join(f"floor {f * 1e3:g} us" for f in FLOORS_MS) + " | measured ms |")
    print("|---" * (len(FLOORS_MS) + 3) + "|")
    for name in ("llama-1b", "gpt2", "vit-b16", "resnet50"):
        ms = per_op_ms(cuda_validation.CASES[name]())
        cells = " | ".join(f"{sum(max(m, f) for m in ms):.1f}" for f in FLOORS_MS)
        print(f"| {name} | {len(ms)} | {cells} | {measured[name]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
