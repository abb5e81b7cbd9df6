"""What checking a plain region planned without RNG state costs per call (sacplan.apply.rng), on this CPU.

    PYTHONPATH=$PWD python3 benchmarks/rng_check_cost.py [--dim 64] [--rounds 7] [--calls 200] [--threads 1]

Two figures:

* ``check``: one call's check alone — :func:`~sacplan.apply.rng.generator_states` before and after the forward and
  the comparison (CPU tensors: the CPU generator's 5,056-byte state, read twice);
* ``step``: forward + backward of a 4-block MLP whose blocks are planned fully checkpointed without RNG state (plain
  checkpoint after each region's first call), with the check as applied and with it disabled, timed in interleaved
  rounds (median of the rounds' per-step means), so drift hits both alike. One intra-op thread by default: on a
  shared 2-core host two spinning OpenMP threads make a step 10-100x slower and the figures noise.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import sacplan.apply as apply_mod
from sacplan.apply import apply_plan
from sacplan.apply.rng import generator_states
from sacplan.plan import ModuleDecision, Plan


def _plan(fqns: list[str]) -> Plan:
    return Plan(
        decisions=tuple(ModuleDecision(fqn=f, saved_ops=None, preserve_rng_state=False) for f in fqns),
        budget_bytes=1, predicted_peak_bytes=1, baseline_peak_bytes=1, recompute_ms=0.0, baseline_step_ms=0.0,
        status="optimal", objective_ms=0.0, bound_ms=0.0, gap=0.0, solver="benchmark", build_s=0.0, solve_s=0.0,
        world_size=1, device_name="cpu", model_name="mlp", fingerprint="",
    )


def _model(dim: int) -> nn.Module:
    return nn.Sequential(*(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(4)))


def _check_us(calls: int) -> float:
    x = torch.ones(8)
    t0 = time.perf_counter()
    for _ in range(calls):
        before = generator_states((x,))
        if generator_states((x,)) != before:
            raise AssertionError("nothing was drawn")
    return (time.perf_counter() - t0) / calls * 1e6


def _step_ms(model: nn.Module, x: torch.Tensor, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        model(x).sum().backward()
    return (time.perf_counter() - t0) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model, x = _model(a.dim), torch.randn(16, a.dim)
    apply_plan(model, _plan([str(i) for i in range(4)]))
    _step_ms(model, x, 3)  # first calls (under the policy), then plain
    real = apply_mod.generator_states
    checks, with_check, without = [], [], []
    for _ in range(a.rounds):
        checks.append(_check_us(a.calls))
        apply_mod.generator_states = real
        with_check.append(_step_ms(model, x, a.calls // 4))
        apply_mod.generator_states = lambda tensors: ()  # type: ignore[assignment]
        without.append(_step_ms(model, x, a.calls // 4))
    apply_mod.generator_states = real
    c, w, n = statistics.median(checks), statistics.median(with_check), statistics.median(without)
    diffs = sorted((wi - ni) * 1e3 / 4 for wi, ni in zip(with_check, without))  # us per region call, per round
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), dim {a.dim}, batch 16, 4 plain regions")
    print(f"check per call: {c:.2f} us (median of {a.rounds} rounds x {a.calls} calls)")
    print(f"step ms (median of {a.rounds} rounds x {a.calls // 4} steps): with the check {w:.3f}, without {n:.3f}; "
          f"per region call, with - without, per round: median {statistics.median(diffs):+.1f} us, "
          f"range {diffs[0]:+.1f} .. {diffs[-1]:+.1f} us")


if __name__ == "__main__":
    main()
