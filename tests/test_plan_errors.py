"""Plan objects (issue 15): deep-copy and pickle like any value; from_dict refuses what is not a plan."""

from __future__ import annotations

import copy
import pickle

import pytest

from sacplan.plan import ModuleDecision, Plan


def _plan() -> Plan:
    return Plan(
        decisions=(ModuleDecision("a", saved_ops=((1, "aten.mm.default", 0),)),), budget_bytes=1, predicted_peak_bytes=1,
        baseline_peak_bytes=2, recompute_ms=1.0, baseline_step_ms=2.0, status="optimal", objective_ms=1.0, bound_ms=1.0,
        gap=0.0, solver="cbc", build_s=0.0, solve_s=0.0, world_size=1, device_name="x", model_name="m", fingerprint="f",
        per_module_peak={"a": 3}, meta={"k": [1, 2]},
    )


def test_plan_deepcopies_and_pickles():
    p = _plan()
    for q in (copy.deepcopy(p), pickle.loads(pickle.dumps(p)), copy.copy(p)):
        assert q == p and q.to_dict() == p.to_dict()
        assert dict(q.per_module_peak) == {"a": 3}
        with pytest.raises(TypeError):
            q.meta["k"] = 1  # still read-only


@pytest.mark.parametrize("d", [None, [], {"version": 0}, {"version": "1"}])
def test_plan_from_dict_refuses_non_plans(d):
    from sacplan.errors import PlanError

    with pytest.raises(PlanError):
        Plan.from_dict(d)
