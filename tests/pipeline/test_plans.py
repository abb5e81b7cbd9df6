"""One plan file for every pipeline stage: solve_pipeline, save/load, and apply_plan(stage_module, plan, stage=i)."""

from __future__ import annotations

import json

import pytest
import torch

import sacplan
from sacplan.apply import applied_plan
from sacplan.errors import ConfigError, PlanError, PlanMismatchError
from sacplan.pipeline import PipelinePlan, collect_pipeline, solve_pipeline
from sacplan.solver import min_feasible_budget
from sacplan.tree import ModuleTree
from sacplan.units import Bytes
from tests.pipeline._stages import batch, stage_fns

M = 4


@pytest.fixture(scope="module")
def interleaved():
    """2 ranks holding stages (0, 2) and (1, 3), planned 30% of the way from the minimum to the baseline (with one
    block per stage the plan checkpoints whole stages: the rank's ``stage<i>`` is the stage module's root)."""
    fns = stage_fns(4, blocks=1)
    stats = collect_pipeline(fns, batch(4 * M), schedule="Interleaved1F1B", microbatches=M, num_ranks=2, device="cpu")
    budgets = []
    for s in stats:
        lo = min_feasible_budget(ModuleTree(s))
        budgets.append(Bytes(int(lo + 0.3 * (s.peak_bytes - lo))))
    return fns, stats, solve_pipeline(stats, budgets)


def test_each_stage_gets_its_part_named_as_in_the_stage_module(interleaved):
    fns, stats, plan = interleaved
    assert plan.rank_stages == ((0, 2), (1, 3)) and plan.schedule == "ScheduleInterleaved1F1B"
    for r, rank_plan in enumerate(plan.plans):
        assert rank_plan.predicted_peak_bytes <= rank_plan.budget_bytes
        parts = {i: plan.for_stage(i) for i in plan.rank_stages[r]}
        # the rank's decisions are exactly its stages' parts, prefixed
        assert sorted(d.fqn for d in rank_plan.decisions) == sorted(
            f"stage{i}.{d.fqn}" if d.fqn else f"stage{i}" for i, p in parts.items() for d in p.decisions)
        for i, p in parts.items():
            names = {n for n, _ in fns[i]().named_modules()}
            assert all(d.fqn in names for d in p.decisions)
            assert p.fingerprint == stats[0].meta["pipeline"]["stage_fingerprints"][i]
    assert any(plan.for_stage(i).decisions for i in range(4))


def test_one_file_round_trips_and_apply_plan_picks_the_stage(interleaved, tmp_path):
    fns, _, plan = interleaved
    path = plan.save(tmp_path / "pp.json")
    doc = json.loads(path.read_text())
    assert doc["schema"] == "sacplan.pipeline-plan-file" and doc["version"] == 1 and len(doc["ranks"]) == 2
    loaded = sacplan.load_plan(path)
    assert isinstance(loaded, PipelinePlan) and loaded.to_dict() == plan.to_dict()
    i = next(i for i in range(4) if plan.for_stage(i).decisions)
    stage = fns[i]()
    sacplan.apply_plan(stage, loaded, stage=i)
    assert {d.fqn for d in applied_plan(stage).decisions} == {d.fqn for d in plan.for_stage(i).decisions}
    text = plan.summary()
    assert all(f"== stage {k} (rank {k % 2}" in text for k in range(4))


def test_the_stage_index_is_checked_against_the_module(interleaved):
    fns, _, plan = interleaved
    with pytest.raises(PlanMismatchError, match="this module is not pipeline stage 3"):
        sacplan.apply_plan(fns[0](), plan, stage=3)  # stage 3 has the head, stage 0 not
    with pytest.raises(ConfigError, match="say which stage this module is"):
        sacplan.apply_plan(fns[0](), plan)
    with pytest.raises(ConfigError, match="stage 7 is not in this pipeline plan"):
        sacplan.apply_plan(fns[0](), plan, stage=7)
    with pytest.raises(ConfigError, match="single-model plan"):
        sacplan.apply_plan(fns[0](), plan.plans[0], stage=0)


def test_newer_or_damaged_files_are_refused(interleaved, tmp_path):
    _, _, plan = interleaved
    path = plan.save(tmp_path / "pp.json")
    doc = json.loads(path.read_text())
    doc["version"] = 99
    (tmp_path / "new.json").write_text(json.dumps(doc))
    with pytest.raises(PlanError, match="version 99, newer than this sacplan supports"):
        sacplan.load_plan(tmp_path / "new.json")
    doc["version"] = 1
    doc["ranks"] = doc["ranks"][:1]
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(PlanError, match="ranks or stages are not 0..n-1"):
        sacplan.load_plan(tmp_path / "bad.json")


def test_solve_pipeline_names_the_rank_that_cannot_fit(interleaved):
    _, stats, _ = interleaved
    with pytest.raises(sacplan.InfeasibleBudgetError, match="pipeline rank 0 of 2"):
        solve_pipeline(stats, Bytes(1000))
    with pytest.raises(ConfigError, match="3 budgets for 2 ranks"):
        solve_pipeline(stats, [Bytes(10**9)] * 3)
    with pytest.raises(ConfigError, match="the list of stats collect_pipeline returned"):
        solve_pipeline([sacplan.collect(torch.nn.Linear(4, 4), torch.randn(2, 4), device="cpu")], Bytes(10**9))


def test_each_ranks_plan_body_is_checked_like_a_plan_files(interleaved, tmp_path):
    _, _, plan = interleaved
    doc = json.loads(plan.save(tmp_path / "pp.json").read_text())
    doc["ranks"][1]["plan"]["decisions"] = [{"fqn": "stage1", "discard_ration": 1.0}]
    (tmp_path / "typo.json").write_text(json.dumps(doc))
    with pytest.raises(PlanError, match=r"ranks\[1\]\.plan: .*discard_ration"):
        sacplan.load_plan(tmp_path / "typo.json")
