"""What one op of a selective-checkpoint region costs beyond plain checkpointing, per op and pass (µs).

    python3 benchmarks/sac_dispatch_cost.py                 # the GPU when there is one, else the CPU
    python3 benchmarks/sac_dispatch_cost.py --device cpu

A module of ``--ops`` small ops (Linear → ReLU → scale, repeated) checkpointed three ways — plain
``torch.utils.checkpoint``, the selective mode with a policy that recomputes everything, and the selective mode
with sacplan's policy (:func:`sacplan.apply.policy.make_policy`, nothing saved) — and timed (forward + backward,
interleaved rounds, median). Every variant recomputes the same ops, so the difference to plain, divided by the
ops the region dispatches in its two passes (forward, recomputation), is the selective mode's dispatch cost per
op and pass: what :attr:`sacplan.devices.DeviceSpec.sac_dispatch_ms` models. Per width: small widths show the
cost as it is (the host runs behind the device), large ones how much of it the device's queue hides.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from sacplan.apply.policy import make_policy


class Chain(nn.Module):
    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x)) * 0.5
        return x


def _ops_per_pass(model: nn.Module, x: torch.Tensor) -> int:
    """Ops the selective mode's policy sees in one forward of ``model`` (what the region dispatches)."""
    seen = []

    def count(ctx, func, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        seen.append(func)
        return CheckpointPolicy.PREFER_RECOMPUTE

    checkpoint(model, x, use_reentrant=False, context_fn=lambda: create_selective_checkpoint_contexts(count))
    return len(seen)


def _variants(model: nn.Module) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    def recompute_all(ctx, func, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        return CheckpointPolicy.PREFER_RECOMPUTE

    return {
        "none": model,
        "plain": lambda x: checkpoint(model, x, use_reentrant=False),
        "selective": lambda x: checkpoint(
            model, x, use_reentrant=False, context_fn=lambda: create_selective_checkpoint_contexts(recompute_all)),
        "sacplan": lambda x: checkpoint(
            model, x, use_reentrant=False,
            context_fn=lambda: create_selective_checkpoint_contexts(make_policy(set(), False, frozenset({1}))),
        ),
    }


def _time(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, device: torch.device, steps: int) -> float:
    """Seconds per forward + backward (mean over ``steps``), the device synchronised at both ends."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn(x).sum().backward()
    sync()
    return (time.perf_counter() - t0) / steps


def measure(device: torch.device, width: int, blocks: int, rounds: int, steps: int) -> dict[str, float]:
    """Median seconds per step of each variant, and the ops per pass."""
    torch.manual_seed(0)
    model = Chain(blocks, width).to(device)
    x = torch.randn(8, width, device=device, requires_grad=True)
    variants = _variants(model)
    for fn in variants.values():  # warm-up
        _time(fn, x, device, 2)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for k, fn in variants.items():
            times[k].append(_time(fn, x, device, steps))
    out = {k: statistics.median(v) for k, v in times.items()}
    out["ops"] = _ops_per_pass(model, x)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--widths", type=int, nargs="*", default=[64, 1024, 4096])
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{name}  torch {torch.__version__}  {args.blocks} blocks, batch 8, median of {args.rounds} rounds")
    print(f"{'width':>6} {'ops/pass':>8} {'none ms':>8} {'plain ms':>8} {'sel us/op':>9} {'sacplan us/op':>13}")
    for w in args.widths:
        r = measure(device, w, args.blocks, args.rounds, args.steps)
        per = 2 * r["ops"]  # forward under the caching mode + recomputation under the cached mode
        sel = (r["selective"] - r["plain"]) / per * 1e6
        sac = (r["sacplan"] - r["plain"]) / per * 1e6
        print(f"{w:6d} {r['ops']:8d} {r['none'] * 1e3:8.2f} {r['plain'] * 1e3:8.2f} {sel:9.1f} {sac:13.1f}", flush=True)


if __name__ == "__main__":
    main()
