"""solve() on budgets that overflow, round to nothing or exceed the target device (issue 15)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.errors import BudgetError, BudgetWarning
from sacplan.solver import solve
from sacplan.budget_sweep import sweep
from sacplan.tree import ModuleTree


@pytest.fixture(scope="module")
def tree():
    model = lambda: nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))  # noqa: E731
    return ModuleTree(collect(model, (torch.randn(32, 16),), device=CPU))


@pytest.mark.parametrize("budget", ["1e400GiB", 10**400, "0.1B", 1e-12, ""])
def test_bad_budgets_are_budget_errors(tree, budget):
    with pytest.raises(BudgetError):
        solve(tree, budget)


def test_budget_above_the_device_warns(tree):
    with pytest.warns(BudgetWarning, match="exceeds the target device's 64.00 GiB"):
        plan = solve(tree, "100GiB")
    assert plan.status == "not needed"


def test_sweep_does_not_warn_about_its_own_points(tree):
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetWarning)
        sweep(tree, [f"{tree.stats.peak_bytes}B"], points=2)
