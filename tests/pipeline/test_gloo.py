"""Per-stage plans proved on real CPU steps: torch.distributed.pipelining's PipelineStage and schedules on gloo ranks
(spawned, FileStore rendezvous), without and with each rank's plan (sacplan.pipeline.validate_pipeline).

For every rank: the measured peak of a steady-state step (sacplan's StepRecorder on the real tensors, the CPU RNG
states checkpoint stashes included) within 1% of the prediction without a plan (the collected stats' peak) and with
it (the plan's), the plan in force (the measured peak drops where the plan discards anything), and the first step's
gradients bitwise equal with and without the plan. The 2-rank 1F1B case runs by default; the other schedules and the
4-rank pipelines under ``-m slow`` (benchmarks/pipeline_validation.py writes the same table to RESULTS.md).
"""

from __future__ import annotations

import pytest

from sacplan.pipeline import collect_pipeline, solve_pipeline, validate_pipeline
from sacplan.solver import min_feasible_budget
from sacplan.tree import ModuleTree
from sacplan.units import Bytes
from tests.pipeline._stages import batch, stage_fns

pytestmark = pytest.mark.distributed


def _prove(schedule: str, ranks: int, per_rank: int, microbatches: int, blocks: int) -> None:
    n = ranks * per_rank
    fns, x = stage_fns(n, blocks=blocks), batch(2 * microbatches)
    stats = collect_pipeline(fns, x, schedule=schedule, microbatches=microbatches, num_ranks=ranks, device="cpu")
    budgets = []
    for s in stats:
        lo = min_feasible_budget(ModuleTree(s))
        budgets.append(Bytes(int(lo + 0.4 * (s.peak_bytes - lo))))
    pplan = solve_pipeline(stats, budgets)  # one plan file's worth: each rank applies it stage by stage
    plans = pplan.plans
    reports = validate_pipeline(fns, x, stats, pplan)
    failures = []
    for r, p in zip(reports, plans):
        print(f"{schedule} p={ranks} rank {r.rank} stages {r.stages}: baseline predicted {r.predicted_baseline} measured "
              f"{r.measured_baseline} ({r.baseline_error:+.3%}); plan {[d.fqn for d in p.decisions]} predicted "
              f"{r.predicted_plan} measured {r.measured_plan} ({r.plan_error:+.3%}); grads equal {r.grads_equal}")
        if abs(r.baseline_error) > 0.01 or abs(r.plan_error) > 0.01:
            failures.append(f"rank {r.rank}: peak off by more than 1%")
        if not r.grads_equal:
            failures.append(f"rank {r.rank}: gradients differ with the plan")
        if p.decisions and not r.measured_plan < r.measured_baseline:
            failures.append(f"rank {r.rank}: the plan did not lower the measured peak")
    assert any(p.decisions for p in plans), "no rank got a plan: the case proves nothing"
    assert not failures, failures


def test_1f1b_two_ranks():
    _prove("1F1B", 2, 1, microbatches=4, blocks=1)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, ranks, per_rank, microbatches", [
    ("GPipe", 2, 1, 4),
    ("Interleaved1F1B", 2, 2, 4),
    ("1F1B", 4, 1, 8),
    ("GPipe", 4, 1, 8),
    ("Interleaved1F1B", 4, 2, 8),
])
def test_schedules(schedule, ranks, per_rank, microbatches):
    _prove(schedule, ranks, per_rank, microbatches, blocks=2)
