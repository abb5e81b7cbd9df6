"""solve() on budgets that overflow, round to nothing or exceed the target device (issue 15)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from sacplan.collector import collect
from sacplan.devices import CPU
import sacplan
from sacplan.errors import BudgetError, BudgetWarning, ConfigError
from sacplan.testing.llama_tree import llama_tree
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


def test_the_collected_stats_are_accepted_and_anything_else_is_a_config_error():
    """Users pass what collect() returned straight to the solver; a wrong object names what to pass."""
    tree = llama_tree(2)
    budget = int(sacplan.baseline_peak(tree) * 0.8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = sacplan.solve(tree, budget), sacplan.solve(tree.stats, budget)
        assert a.recompute_ms == b.recompute_ms and a.predicted_peak_bytes == b.predicted_peak_bytes
        assert sacplan.min_feasible_budget(tree.stats) == sacplan.min_feasible_budget(tree)
        assert sacplan.sac_milp(tree.stats, 30) == sacplan.sac_milp(tree, 30)
        for call in (lambda x: sacplan.solve(x, budget), sacplan.min_feasible_budget, sacplan.baseline_peak,
                     lambda x: sacplan.sweep(x, points=2), lambda x: sacplan.certify(x, budget),
                     lambda x: sacplan.recompute_lower_bound(x, budget)):
            with pytest.raises(ConfigError, match="ModuleTree or the ModelStats"):
                call(None)
        with pytest.raises(ConfigError, match="ilp_utils.Graph, got str"):
            sacplan.sac_milp("graph", 30)
