"""Per-stage plans proved on real CPU steps: torch.distributed.pipelining's PipelineStage and schedules on gloo ranks
(spawned, FileStore rendezvous), without and with each rank's plan (sacplan.pipeline.validate_pipeline).

For every rank: the measured peak of a steady-state step (sacplan's StepRecorder on the real tensors, the CPU RNG
states checkpoint stashes included) within 1% of the prediction without a plan (the collected stats' peak) and with
it (the plan's), the plan in force (the measured peak drops where the plan discards anything), and the first step's
gradients bitwise equal with and without the plan. The 2-rank 1F1B case runs by default; the other schedules, the
4-rank pipelines and the pipelines composed with TP or FSDP2 (4 processes) under ``-m slow``
(benchmarks/pipeline_validation.py writes the same table to RESULTS.md).
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
    pplan = solve_pipeline(stats, _budgets(stats))  # one plan file's worth: each rank applies it stage by stage
    plans = pplan.plans
    reports = validate_pipeline(fns, x, stats, pplan)
    _check(reports, plans, f"{schedule} p={ranks}")


def _budgets(stats) -> list[Bytes]:
    """Per rank, 40% of the way from its minimum feasible budget to its no-checkpointing peak."""
    budgets = []
    for s in stats:
        lo = min_feasible_budget(ModuleTree(s))
        budgets.append(Bytes(int(lo + 0.4 * (s.peak_bytes - lo))))
    return budgets


def _check(reports, plans, case: str) -> None:
    """Every process within 1% of its rank's prediction without and with the plan, the plan in force, gradients
    bitwise equal with and without it."""
    failures = []
    for r in reports:
        p = plans[r.rank]
        print(f"{case} process {r.process} rank {r.rank} stages {r.stages}: baseline predicted {r.predicted_baseline} "
              f"measured {r.measured_baseline} ({r.baseline_error:+.3%}); plan {[d.fqn for d in p.decisions]} predicted "
              f"{r.predicted_plan} measured {r.measured_plan} ({r.plan_error:+.3%}); grads equal {r.grads_equal}")
        if abs(r.baseline_error) > 0.01 or abs(r.plan_error) > 0.01:
            failures.append(f"process {r.process} (rank {r.rank}): peak off by more than 1%")
        if not r.grads_equal:
            failures.append(f"process {r.process} (rank {r.rank}): gradients differ with the plan")
        if p.decisions and not r.measured_plan < r.measured_baseline:
            failures.append(f"process {r.process} (rank {r.rank}): the plan did not lower the measured peak")
    assert any(p.decisions for p in plans), "no rank got a plan: the case proves nothing"
    assert not failures, failures


def test_1f1b_two_ranks():
    _prove("1F1B", 2, 1, microbatches=4, blocks=1)


def test_bf16_llama_stages_as_sacplan_plan_pp_builds_them():
    """`sacplan plan llama-... --pp 2`'s stages (preset_pipeline in --dtype bf16, the rotary table float32) on 2 gloo
    ranks: within 1% without and with the plan, gradients (bf16) bitwise equal. Under 1F1B the first rank's
    microbatches 2 and 3 run their forwards after a backward began, and the plan's checkpointed RMSNorms hold
    their bf16 inputs there too (sacplan.collector.storage's held_by_checkpoint)."""
    import torch

    from sacplan.models import get_model
    from sacplan.pipeline.presets import preset_pipeline

    fns, toks, loss = preset_pipeline(get_model("llama-tiny"), 2, batch=4, seq=64, dtype=torch.bfloat16)
    stats = collect_pipeline(fns, toks, schedule="1F1B", microbatches=4, loss_fn=loss, target=toks, device="cpu")
    pplan = solve_pipeline(stats, _budgets(stats))
    reports = validate_pipeline(fns, toks, stats, pplan, loss_fn=loss, target=toks)
    _check(reports, pplan.plans, "1F1B p=2 bf16 Llama")


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


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
@pytest.mark.parametrize("mesh", [{"tp": 2}, {"dp_shard": 2}], ids=["pp2xtp2", "pp2xdp_shard2"])
def test_1f1b_two_ranks_composed_with_a_mesh(mesh):
    """pp 2 x tp 2 and pp 2 x dp_shard 2 (4 processes each): tiny Llama stages under torchtitan's layout (TP with
    sequence parallelism; FSDP2 without resharding after forward, as under PP) on a gloo DeviceMesh, the
    PipelineStages on the "pp" group; every process within 1% of its pipeline rank's prediction
    (collect_pipeline(mesh=...) on the fake group), without and with the plan, gradients bitwise equal."""
    import functools

    from sacplan.models import get_model
    from sacplan.models.llama_parallel import parallelize_llama
    from sacplan.pipeline.presets import preset_pipeline

    par = functools.partial(parallelize_llama, reshard_after_forward=False)
    fns, toks, loss = preset_pipeline(get_model("llama-tiny"), 2, batch=4, seq=64, dtype=None)
    stats = collect_pipeline(fns, toks, schedule="1F1B", microbatches=4, loss_fn=loss, target=toks, device="cpu",
                             mesh=mesh, parallelize=par)
    pplan = solve_pipeline(stats, _budgets(stats))
    reports = validate_pipeline(fns, toks, stats, pplan, loss_fn=loss, target=toks, parallelize=par)
    assert sorted(r.process for r in reports) == [0, 1, 2, 3] and [r.rank for r in reports] == [0, 0, 1, 1]
    _check(reports, pplan.plans, f"1F1B pp2 x {mesh}")
