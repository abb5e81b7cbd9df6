"""parse_budget on edge inputs (issue 15): numpy scalars, overflow, sub-byte budgets, budgets above the device."""

from __future__ import annotations

import copy
import pickle
import warnings

import numpy as np
import pytest

from sacplan.errors import BudgetError, BudgetWarning
from sacplan.plan import ModuleDecision, Plan
from sacplan.units import GiB, parse_budget


def test_numpy_scalars_are_numbers():
    assert parse_budget(np.int64(2)) == 2 * GiB
    assert parse_budget(np.float32(1.5)) == int(1.5 * GiB)
    assert parse_budget(np.int64(3 * GiB)) == 3 * GiB


@pytest.mark.parametrize("budget", ["1e400GiB", 10**400, "1e300TiB"])
def test_overflowing_budget_is_a_budget_error(budget):
    with pytest.raises(BudgetError, match="too large|finite"):
        parse_budget(budget)


@pytest.mark.parametrize("budget", ["0.1B", 1e-12, "0.4B"])
def test_budget_rounding_to_zero_bytes_is_refused(budget):
    with pytest.raises(BudgetError, match="less than one byte"):
        parse_budget(budget)


def test_budget_above_the_device_warns_once_in_one_line():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert parse_budget("100GiB", capacity_bytes=80 * 10**9) == 100 * GiB
    assert len(w) == 1 and issubclass(w[0].category, BudgetWarning)
    msg = str(w[0].message)
    assert "100.00 GiB" in msg and "74.51 GiB" in msg and "\n" not in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert parse_budget("70GiB", capacity_bytes=80 * 10**9) == 70 * GiB  # below: no warning


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
