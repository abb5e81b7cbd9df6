"""collect() on bad or unusual input (issue 15): typed errors that say what to do, BatchNorm(momentum=None)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sacplan.collector import collect
from sacplan.devices import CPU
from sacplan.errors import ConfigError


def _frozen() -> nn.Module:
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def test_no_trainable_parameters_suggests_optimizer_false():
    with pytest.raises(ConfigError, match="optimizer=False"):
        collect(_frozen(), (torch.randn(8, 4),), device=CPU)


def test_no_trainable_parameters_with_optimizer_false_and_input_gradients():
    x = torch.randn(8, 4, requires_grad=True)
    stats = collect(_frozen(), (x,), device=CPU, optimizer=False)
    assert stats.optimizer_bytes == 0 and stats.modules


@pytest.mark.parametrize("opt", ["adam", 3, torch.optim.Adam([torch.zeros(1, requires_grad=True)])])
def test_optimizer_must_be_a_factory(opt):
    with pytest.raises(ConfigError, match="optimizer must be a factory"):
        collect(nn.Linear(4, 4), (torch.randn(2, 4),), device=CPU, optimizer=opt)


@pytest.mark.parametrize("max_lines", [0, -1, 1.5, True])
def test_max_lines_must_be_positive(max_lines):
    with pytest.raises(ConfigError, match="max_lines"):
        collect(nn.Linear(4, 4), (torch.randn(2, 4),), device=CPU, max_lines=max_lines)


def test_batchnorm_cumulative_average_collects_like_a_fixed_momentum():
    """momentum=None (cumulative moving average) runs the same ops on the same bytes as momentum=0.1."""

    def model(momentum):
        return lambda: nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32, momentum=momentum), nn.ReLU(), nn.Linear(32, 1))

    x = torch.randn(64, 16)
    cma = collect(model(None), (x,), device=CPU)
    ema = collect(model(0.1), (x,), device=CPU)
    assert cma.peak_bytes == ema.peak_bytes
    assert [m.fqn for m in cma.modules] == [m.fqn for m in ema.modules]
    assert [[o.name for o in m.ops] for m in cma.modules] == [[o.name for o in m.ops] for m in ema.modules]


def test_batchnorm_cumulative_average_of_a_user_module_is_left_alone():
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None))
    collect(m, (torch.randn(8, 4),), device=CPU)
    assert m[1].momentum is None and int(m[1].num_batches_tracked) == 0


def test_batchnorm_cumulative_average_plans_and_applies_exactly():
    """End to end: the plan for a momentum=None model applies with the same gradients and running statistics."""
    from sacplan.apply import apply_plan
    from sacplan.solver import min_feasible_budget, solve
    from sacplan.tree import ModuleTree

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.bn, self.out = nn.Linear(16, 64), nn.BatchNorm1d(64, momentum=None), nn.Linear(64, 16)

        def forward(self, x):
            return x + self.out(torch.relu(self.bn(self.lin(x))))

    def build():
        torch.manual_seed(0)
        return nn.Sequential(Block(), Block(), Block(), nn.Linear(16, 1))

    x = torch.randn(32, 16)
    tree = ModuleTree(collect(build, (x,), device=CPU))
    plan = solve(tree, f"{min_feasible_budget(tree)}B")
    assert plan.decisions
    plain, planned = build(), apply_plan(build(), plan)
    for _ in range(2):
        for m in (plain, planned):
            m(x).pow(2).mean().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), planned.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(plain.buffers(), planned.buffers()))
    assert int(planned[0].bn.num_batches_tracked) == 2
